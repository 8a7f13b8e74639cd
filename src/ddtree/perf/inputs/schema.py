"""The shape of the estimator's input files as pydantic models: which sections and fields a
scenario file (``ddtree estimate``) and a corpus point file (``data/validation/*.toml``) may
hold, which are tables, arrays of tables, strings, booleans or lists of strings. A field a
model does not declare is refused, naming it (``extra="forbid"``); nothing is coerced
(``strict``: ``"8"`` is not an integer, ``1`` is not ``true``).

Quantities with units (``"8 TB/s"``, ``[12, 16]``) and names that refer to something else (a
hardware key, a policy, an engine) are ``Any`` here: the readers convert and check them, as
they need the catalog, the model and the policy to do it.

``parse`` turns pydantic's ``ValidationError`` into the readers' one-line ``ScenarioError``:
the file, the field's full path (``s.toml: scenario[0] (B300 now).article.note``), and what
was expected. An item of an array of tables is named by its ``name`` (or the default name a
reader gives it).
"""

from __future__ import annotations

import types
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from ddtree.perf.cost.step import ENGINE_PARAMS
from ddtree.perf.inputs.values import ScenarioError, type_name


class Table(BaseModel):
    """A TOML table: every field declared, no coercion."""

    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


# ---- scenario files ---------------------------------------------------------------------------


class DeploymentFields(Table):
    """What places a point: set in ``[deployment]`` for every anchor and case, or per entry."""

    tp: Any = None
    concurrency: Any = None
    context: Any = None
    engine: Any = None
    policy: Any = None
    parallel: Any = None
    gpus_per_node: Any = None
    inter_node: Any = None
    num_steps: Any = None
    topk: Any = None
    num_draft_tokens: Any = None
    host_cpu: Any = None
    stack: Any = None


class StepFields(DeploymentFields):
    """A measured decode step: the point, tau, what the figure measures and the figure."""

    hardware: Any = None
    block_size: Any = None
    budget: Any = None
    tau: Any = None
    tokens_per_s: Any = None
    step: Any = None
    tpot: Any = None
    itl: Any = None
    metric: Any = None
    prompt_tokens: Any = None
    output_tokens: Any = None
    counts_prompt: bool | None = None
    ttft: Any = None


class AnchorFields(Table):
    kind: Any = None
    name: str | None = None
    source: str | None = None
    noise: Any = None


class StepAnchorTable(StepFields, AnchorFields):
    """``[[anchor]]`` of kind ``step`` (the default)."""


class MoeAnchorTable(AnchorFields):
    """``[[anchor]]`` of kind ``moe_layer``: one routed-MoE layer's time at M tokens."""

    hardware: Any = None
    m: Any = None
    time: Any = None
    tp: Any = None


class DrafterTable(Table):
    """``[drafter]``: ``params`` and ``layers``, or only ``precision`` / ``source`` for MTP."""

    params: Any = None
    layers: Any = None
    precision: Any = None
    kv_bytes_per_token: Any = None
    shares_target_lm_head: bool | None = None
    source: str | None = None
    lm_head_vocab: Any = None


class ArticleTable(Table):
    """A case's published answer, to compare the projection with."""

    tokens_per_s: Any = None
    step: Any = None
    moe: Any = None
    note: str | None = None


class CaseTable(DeploymentFields):
    """``[[scenario]]``: one question to project."""

    name: str | None = None
    question: str | None = None
    hardware: Any = None
    block_size: Any = None
    budget: Any = None
    tau: Any = None
    anchors: list[str] | None = None
    parameters: dict[str, Any] | None = None
    article: ArticleTable | None = None
    drafter: DrafterTable | None = None


class ParallelTable(Table):
    """``parallel = { attention = "tp", moe_tp = 2, moe_ep = 4 }``."""

    attention: Any = None
    moe_tp: Any = None
    moe_ep: Any = None


class ParamTable(Table):
    """``[parameters]`` ``x = { value = v, range = [lo, hi], fit = true, source = "..." }``."""

    value: Any = None
    range: Any = None
    fit: bool | None = None
    source: str | None = None


EngineTable = create_model(
    "EngineTable",
    __base__=Table,
    __doc__="``[engine.NAME]``: an engine profile's host figures (``ENGINE_PARAMS``), ``about``.",
    about=(str | None, None),
    **{f: (Any, None) for f in ENGINE_PARAMS},
)


class ReportTable(Table):
    hardware: list[str] | None = None


class RecordsTable(Table):
    paths: list[str] | None = None


class ScenarioDoc(Table):
    """A scenario file's sections. Anchors are checked one by one (their fields depend on
    their ``kind``); hardware, link and model tables by the catalog and model readers."""

    title: str | None = None
    model: dict[str, Any] | None = None
    drafter: DrafterTable | None = None
    deployment: DeploymentFields | None = None
    hardware: dict[str, dict[str, Any]] | None = None
    link: dict[str, dict[str, Any]] | None = None
    engine: dict[str, EngineTable] | None = None  # type: ignore[valid-type]
    parameters: dict[str, Any] | None = None
    report: ReportTable | None = None
    records: RecordsTable | None = None
    anchor: list[dict[str, Any]] | None = None
    scenario: list[CaseTable] | None = None


SCENARIO_NAMES = {"anchor": "anchor{i}", "scenario": "scenario{i}"}
"""The name a reader gives an array item that has none (``scenario[0] (scenario0)``)."""


# ---- ValidationError -> one line naming the file and the field --------------------------------

M = TypeVar("M", bound=BaseModel)


def parse(
    cls: type[M], raw: Any, where: str, top: bool = False, names: dict[str, str] | None = None
) -> M:
    """``raw`` as ``cls``, or a ``ScenarioError`` naming the field. ``where`` locates ``raw``:
    the file itself (``top``: a field follows as ``file: field``) or an entry in it (``file:
    anchor[0] (a)``: a field follows as ``.field``). ``names`` gives each array of tables
    the default name of an item without one (``"scenario{i}"``)."""
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise ScenarioError(message(cls, raw, where, exc, top, names or {})) from None


def message(
    cls: type[BaseModel], raw: Any, where: str, exc: ValidationError, top: bool, names: dict
) -> str:
    """The first error (unknown fields first, all of one table's together), as today's
    readers word it."""
    errors = exc.errors(include_url=False)
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    err = extra[0] if extra else errors[0]
    loc, got = tuple(err["loc"]), err.get("input")

    def at(path: tuple) -> str:
        return _label(where, path, raw, top, names)

    kind = err["type"]
    if kind == "extra_forbidden":
        parent = loc[:-1]
        unknown = sorted(str(e["loc"][-1]) for e in extra if tuple(e["loc"][:-1]) == parent)
        allowed = sorted(_fields_at(cls, parent))
        return (
            f"{at(parent)}: unknown field(s) {', '.join(unknown)}; "
            f"expected some of {', '.join(allowed)}"
        )
    if kind == "value_error":  # a validator's own sentence
        return f"{at(loc)}: {err['ctx']['error']}"
    if kind == "missing":
        return f"{at(loc[:-1])}: missing field '{loc[-1]}'"
    if kind == "string_type" and loc and isinstance(loc[-1], int):  # an item of a list[str]
        return f"{at(loc[:-1])}: expected a list of strings, got {_get(raw, loc[:-1])!r:.60}"
    if kind == "string_type":
        return f"{at(loc)}: expected a string, got {type_name(got)} ({got!r:.60})"
    if kind == "bool_type":
        return f"{at(loc)}: expected true or false, got {type_name(got)} ({got!r:.60})"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        if top and len(loc) == 2 and loc[0] in names:  # a scenario file's [[anchor]] = [1]
            return (
                f"{where}: {loc[0]} must be an array of tables ([[{loc[0]}]]), "
                f"got {type_name(_get(raw, loc[:1]))}"
            )
        if len(loc) >= 2 and isinstance(loc[-1], int):  # an item of an array of tables
            return f"{at(loc)} must be a table ([[{loc[-2]}]])"
        if top and len(loc) == 1:
            return f"{where}: {loc[0]} must be a table ([{loc[0]}]), got {type_name(got)}"
        return f"{at(loc)}: expected a table, got {type_name(got)} ({got!r:.60})"
    if kind == "list_type":
        if top and len(loc) == 1 and _is_tables(_fields_type(cls, loc)):
            return (
                f"{where}: {loc[0]} must be an array of tables ([[{loc[0]}]]), got {type_name(got)}"
            )
        return f"{at(loc)}: expected a list of strings, got {got!r:.60}"
    return f"{at(loc)}: {err['msg']}, got {got!r:.60}"


def _label(where: str, loc: tuple, raw: Any, top: bool, names: dict) -> str:
    """``file: scenario[0] (name).article.note``: list items by index and name."""
    parts: list[str] = []
    node = raw
    for i, key in enumerate(loc):
        if isinstance(key, int):
            item = node[key] if isinstance(node, list) and key < len(node) else None
            label = f"[{key}]"
            array = loc[i - 1] if i else None
            if array in names and isinstance(item, dict):
                name = item.get("name", names[array].format(i=key))
                if isinstance(name, str) and loc[i + 1 :] != ("name",):
                    label += f" ({name})"
            parts.append(label)
            node = item
        else:
            parts.append(f".{key}" if parts else str(key))
            node = node.get(key) if isinstance(node, dict) else None
    path = "".join(parts)
    if not path:
        return where
    return f"{where}: {path}" if top else f"{where}.{path}"


def _get(raw: Any, loc: tuple) -> Any:
    for key in loc:
        if isinstance(raw, dict):
            raw = raw.get(key)
        elif isinstance(raw, list) and isinstance(key, int) and key < len(raw):
            raw = raw[key]
        else:
            return None
    return raw


def _optional(t: Any) -> Any:
    """``X | None`` -> ``X``."""
    if get_origin(t) in (Union, types.UnionType):
        args = [a for a in get_args(t) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return t


def _fields_type(cls: type[BaseModel], loc: tuple) -> Any:
    """The declared type at ``loc`` (a field of a model, an item of a list or dict)."""
    t: Any = cls
    for key in loc:
        t = _optional(t)
        if isinstance(key, str) and isinstance(t, type) and issubclass(t, BaseModel):
            t = t.model_fields[key].annotation
        else:
            args = get_args(t)
            t = args[-1] if args else Any
    return _optional(t)


def _fields_at(cls: type[BaseModel], loc: tuple) -> list[str]:
    t = _fields_type(cls, loc)
    return list(t.model_fields) if isinstance(t, type) and issubclass(t, BaseModel) else []


def _is_tables(t: Any) -> bool:
    """A list of tables (``[[anchor]]``), not of strings."""
    args = get_args(t)
    item = _optional(args[0]) if args else None
    return get_origin(item) is dict or (isinstance(item, type) and issubclass(item, BaseModel))
