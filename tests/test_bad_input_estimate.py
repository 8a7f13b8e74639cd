"""Bad estimator input, table-driven (issue 21), beside ``test_bad_input.py`` and with its
pieces: each case changes one thing in the same valid scenario and must exit 2 with exactly one
line on stderr naming the file and field and what was expected, no traceback, no file touched.

Classes: a value of the wrong TOML type in any field of the scenario schema (a table or list
where a string is, a string where a table or list of tables is, a string where a boolean is);
hardware figures at 0, negative or NaN (a bandwidth or FLOP rate divides a time); a tau above
what the tree can commit (a tree of N nodes commits at most N + 1 tokens); negative sizes and
rates (drafter, article); a routed-MoE anchor on a dense model; a records file nested deeper
than the JSON parser recurses, given to the estimator.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree.cli import main
from test_bad_input import SCENARIO, Case, run_bad_input

# the scenario's cases on a hardware table of the file's own ("x")
ON_X = ('hardware = "b300"\nblock_size = 16', 'hardware = "x"\nblock_size = 16')
X = '\n[hardware.x]\nhbm_bandwidth = "8 TB/s"\nbf16_dense = "2.5 PFLOP/s"\n'
DRAFTER = '\n[drafter]\nparams = 1.5e9\nlayers = 3\nkv_bytes_per_token = "12 kB"\n'
MOE_ANCHOR = (
    '\n[[anchor]]\nname = "m"\nkind = "moe_layer"\nhardware = "b300"\nm = 9\ntime = "1 ms"\n'
)
CASE_BLOCK = SCENARIO[SCENARIO.index("[[scenario]]") :]
END = None  # "old" of a change that appends its text to the end of the file
SCEN = 'name = "s"'  # a line of the scenario's case, to add a field after
ANCH = 'name = "a"'  # a line of the anchor's

CHANGES = {  # id -> (text replaced or END, replacement, expected in the message)
    # hardware figures: a bandwidth or FLOP rate of 0 divided by zero; negative ones gave
    # negative tokens/s with exit 0
    "hbm-zero": (END, X.replace('"8 TB/s"', '"0 TB/s"'), ("hardware.x.hbm_bandwidth", "> 0")),
    "hbm-negative": (END, X.replace('"8 TB/s"', '"-8 TB/s"'), ("hardware.x.hbm_bandwidth", "> 0")),
    "hbm-nan": (END, X.replace('"8 TB/s"', '"nan TB/s"'), ("hardware.x.hbm_bandwidth", "bandwidth")),
    "bf16-dense-zero": (END, X.replace('"2.5 PFLOP/s"', '"0 PFLOP/s"'), ("hardware.x.bf16_dense", "> 0")),
    "fp8-dense-negative": (END, X + 'fp8_dense = "-5 PFLOP/s"\n', ("hardware.x.fp8_dense", "> 0")),
    "memory-negative": (END, X + 'memory = "-80 GB"\n', ("hardware.x.memory", ">= 0")),
    "link-bandwidth-negative": (END, X + 'link_bandwidth = "-900 GB/s"\n', ("hardware.x.link_bandwidth", ">= 0")),
    "allreduce-latency-negative": (END, X + 'allreduce_latency = "-20 us"\n', ("hardware.x.allreduce_latency", ">= 0")),
    "base-hbm-zero": (END, '\n[hardware.x]\nbase = "b300"\nhbm_bandwidth = "0 TB/s"\n', ("hardware.x.hbm_bandwidth", "> 0")),
    "hardware-name-list": (END, X + "name = [1]\n", ("hardware.x.name", "expected a string")),
    "hardware-base-list": (END, '\n[hardware.x]\nbase = ["b300"]\n', ("hardware.x.base", "hardware name")),
    "hardware-figure-unknown-field": (END, X + 'fp8_dense = { value = "5 PFLOP/s", sorce = "me" }\n', ("x.fp8_dense", "sorce")),
    "hardware-figure-source-list": (END, X + 'fp8_dense = { value = "5 PFLOP/s", source = [1] }\n', ("x.fp8_dense", "'source' is a string")),
    # a hardware reference that is not a name
    "case-hardware-table": (ON_X[0], 'hardware = { hbm_bandwidth = "8 TB/s" }\nblock_size = 16', ("scenario[0]", "hardware", "hardware name")),
    "case-hardware-list": (ON_X[0], 'hardware = ["b300"]\nblock_size = 16', ("scenario[0]", "hardware", "hardware name")),
    # a section of the wrong kind
    "hardware-section-list": ("[model]", "hardware = [1]\n[model]", ("hardware must be a table",)),
    "link-section-list": ("[model]", "link = [1]\n[model]", ("link must be a table",)),
    "engine-section-list": ("[model]", 'engine = ["native"]\n[model]', ("engine must be a table",)),
    "parameters-section-list": ("[model]", "parameters = [1]\n[model]", ("parameters must be a table",)),
    "scenario-section-table": ("[[scenario]]", "[scenario]", ("scenario must be an array of tables",)),
    "scenario-array-of-numbers": (CASE_BLOCK, "", ("scenario must be an array of tables",)),
    "title-table": ("[model]", "title = { a = 1 }\n[model]", ("title", "expected a string")),
    "report-hardware-string": (END, '\n[report]\nhardware = "b300"\n', ("report.hardware", "list of strings")),
    "records-paths-string": (END, '\n[records]\npaths = "runs.jsonl"\n', ("records.paths", "list of strings")),
    "model-config-number": ('preset = "kimi-k2-thinking"', "config = 3", ("model.config", "expected a string")),
    # anchors
    "anchor-name-table": (ANCH, "name = { a = 1 }", ("anchor[0].name", "expected a string")),
    "anchor-source-list": (ANCH, f"{ANCH}\nsource = [1]", ("anchor[0] (a).source", "expected a string")),
    "anchor-counts-prompt-string": ('tokens_per_s = "303 tok/s"', 'tokens_per_s = "303 tok/s"\nmetric = "e2e_tokens_per_s"\nprompt_tokens = 100\noutput_tokens = 100\ncounts_prompt = "no"', ("counts_prompt", "true or false")),
    "anchor-noise-denormal": (ANCH, f"{ANCH}\nnoise = 5e-324", ("anchor[0] (a).noise", "[0.001, 1)")),
    "anchor-tau-above-budget": ("budget = 8", "budget = 2", ("anchor[0] (a).tau", "budget + 1 = 3")),
    "anchor-moe-on-dense-model": ("kimi-k2-thinking", "llama-3.1-8b", ("anchor[1] (m).kind", "dense")),
    # scenario cases
    "case-block-size-past-positions": ("block_size = 16", "block_size = 1000000000000", ("block size 1000000000000", "max_position_embeddings")),
    "case-tau-above-budget": ("budget = 32", "budget = 4", ("scenario[0] (s).tau", "budget + 1 = 5")),
    "case-tau-range-above-budget": ("budget = 32\ntau = 6.0", "budget = 4\ntau = [2, 6]", ("scenario[0] (s).tau", "budget + 1 = 5")),
    "case-name-list": (SCEN, "name = [1]", ("scenario[0].name", "expected a string")),
    "case-question-table": (SCEN, f"{SCEN}\nquestion = {{ a = 1 }}", ("scenario[0] (s).question", "expected a string")),
    "case-anchors-string": (SCEN, f'{SCEN}\nanchors = "a"', ("scenario[0] (s).anchors", "list of strings")),
    "case-anchors-number": (SCEN, f"{SCEN}\nanchors = 3", ("scenario[0] (s).anchors", "list of strings")),
    "case-parameters-list": (SCEN, f"{SCEN}\nparameters = [1]", ("scenario[0] (s).parameters", "expected a table")),
    "case-article-string": (END, 'article = "303 tok/s"\n', ("scenario[0] (s).article", "expected a table")),
    "case-article-list": (END, "article = [1]\n", ("scenario[0] (s).article", "expected a table")),
    "case-article-rate-negative": (END, 'article = { tokens_per_s = "-303 tok/s" }\n', ("article.tokens_per_s", "positive")),
    "case-article-range-from-zero": (END, 'article = { tokens_per_s = ["0 tok/s", "5 tok/s"] }\n', ("article.tokens_per_s", "positive")),
    "case-article-note-list": (END, "article = { note = [1] }\n", ("article.note", "expected a string")),
    "case-policy-list": (SCEN, f'{SCEN}\npolicy = ["ar"]', ("scenario[0] (s).policy", "expected one of")),
    "case-policy-table": (SCEN, f"{SCEN}\npolicy = {{ a = 1 }}", ("scenario[0] (s).policy", "expected one of")),
    "case-parallel-list": (SCEN, f'{SCEN}\nparallel = ["tp"]', ("scenario[0] (s).parallel", "expected one of")),
    "case-inter-node-list": (SCEN, f'{SCEN}\ninter_node = ["ib-ndr"]', ("scenario[0] (s).inter_node", "known links")),
    "case-host-cpu-list": (SCEN, f'{SCEN}\nhost_cpu = ["grace"]', ("scenario[0] (s).host_cpu", "expected a string")),
    "case-engine-list": (SCEN, f'{SCEN}\nengine = ["eager"]', ("scenario[0] (s).engine", "expected a string")),
    "case-tau-records-list": ("tau = 6.0", 'tau = { records = ["acc.jsonl"] }', ("scenario[0] (s).tau.records", "expected a string")),
    # the drafter, the parameters and the engine profiles
    "drafter-params-negative": (END, DRAFTER.replace("1.5e9", "-1.5e9"), ("drafter.params", "positive")),
    "drafter-kv-negative": (END, DRAFTER.replace('"12 kB"', '"-12 kB"'), ("drafter.kv_bytes_per_token", ">= 0")),
    "drafter-shares-head-string": (END, DRAFTER + 'shares_target_lm_head = "no"\n', ("drafter.shares_target_lm_head", "true or false")),
    "drafter-source-list": (END, DRAFTER + "source = [1]\n", ("drafter.source", "expected a string")),
    "parameter-fit-string": (END, '\n[parameters]\n"allreduce_scale.pcie" = { value = 1.0, fit = "no" }\n', ("parameters.allreduce_scale.pcie.fit", "true or false")),
    "engine-about-list": (END, '\n[engine.native]\nabout = [1]\n', ("engine.native.about", "expected a string")),
}  # fmt: skip

CASES = [
    Case(f"estimate-{name}", f"estimate {{w}}/scenarios/{name}.toml", ("scenarios/", *expect))
    for name, (_, _, expect) in CHANGES.items()
] + [
    Case(
        "estimate-records-nested-too-deeply",
        "estimate {w}/scenarios/base.toml --records {w}/records/deep.jsonl",
        ("deep.jsonl:1", "JSON nested too deeply"),
    ),
    Case(
        "backtest-records-nested-too-deeply",
        "estimate --backtest {w}/records/deep.jsonl",
        ("deep.jsonl:1", "JSON nested too deeply"),
    ),
]


def _text(name: str) -> str:
    old, new, _ = CHANGES[name]
    if name.startswith(("hbm-", "bf16-", "fp8-", "memory-", "link-bandwidth", "allreduce-")):
        base = SCENARIO.replace(*ON_X, 1)  # the case runs on the file's hardware x
    elif name == "scenario-array-of-numbers":
        base = "scenario = [1, 2]\n" + SCENARIO  # and the [[scenario]] block removed
    elif name == "anchor-moe-on-dense-model":
        base = SCENARIO.replace("tp = 8", "tp = 1") + MOE_ANCHOR
    else:
        base = SCENARIO
    if old is END:
        return base + new
    assert old in base, name
    return base.replace(old, new, 1)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("bad_estimate")
    (w / "scenarios").mkdir()
    (w / "scenarios" / "base.toml").write_text(SCENARIO)
    for name in CHANGES:
        (w / "scenarios" / f"{name}.toml").write_text(_text(name))
    (w / "records").mkdir()
    (w / "records" / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    (w / "work").mkdir()
    return w


def test_the_table_has_over_40_cases_with_unique_ids():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


def test_the_base_scenario_runs(world, capsys):
    assert main(["estimate", str(world / "scenarios" / "base.toml"), "--samples", "200"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_estimator_input_gets_one_line_naming_what_was_expected(
    case, world, capsys, monkeypatch
):
    monkeypatch.chdir(world / "work")
    monkeypatch.delenv("DDTREE_DEBUG", raising=False)
    run_bad_input(
        [*case.argv.format(w=world).split(), "--samples", "200"], world, case.expect, capsys
    )
