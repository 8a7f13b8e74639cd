"""The input files' pydantic models (``ddtree.perf.inputs.schema``): an error names the file,
the field's full path, and what was expected, in the readers' words."""

import pytest

from ddtree.perf.inputs.scenario import ScenarioError, load_scenario
from ddtree.perf.validation import corpus

CASE = '[model]\npreset = "kimi-k2"\n[[scenario]]\nname = "q"\nhardware = "b300"\nblock_size = 8\nbudget = 7\ntau = 4\n'  # fmt: skip
SOURCE = '[source]\nkey = "x"\nkind = "issue"\nurl = "u"\n'
POINT = '[[point]]\nname = "p"\nwhat = "w"\nmodel = {preset = "qwen3-8b"}\nhardware = "h100-sxm"\npolicy = "ar"\ntokens_per_s = "90 tok/s"\n'  # fmt: skip


@pytest.mark.parametrize(
    "text,message",
    [
        # a nested field: the full path, through the array item (named) and the inline table
        (CASE + 'article = { note = 3, tokens_per_s = "300 tok/s" }\n',
         "s.toml: scenario[0] (q).article.note: expected a string, got an integer (3)"),
        (CASE + 'drafter = { params = 1e9, layers = 1, colour = "red" }\n',
         "s.toml: scenario[0] (q).drafter: unknown field(s) colour; expected some of "
         "kv_bytes_per_token, layers, lm_head_vocab, params, precision, shares_target_lm_head, "
         "source"),
        (CASE + 'anchors = ["a", 2]\n', "s.toml: scenario[0] (q).anchors: expected a list of strings"),
        (CASE + 'parameters = { x = { fit = 1 } }\n', "scenario[0] (q).parameters"),
        (CASE.replace('name = "q"', "name = 5"), "s.toml: scenario[0].name: expected a string"),
        ('deployment = 3\n[model]\npreset = "kimi-k2"\n',
         "s.toml: deployment must be a table ([deployment]), got an integer"),
        ('scenario = 3\n[model]\npreset = "kimi-k2"\n',
         "s.toml: scenario must be an array of tables ([[scenario]]), got an integer"),
        ('[model]\npreset = "kimi-k2"\n[deployment]\ntp = 1\nspeed = 2\n',
         "s.toml: deployment: unknown field(s) speed; expected some of concurrency, context"),
        ('[model]\npreset = "kimi-k2"\n[engine.eager]\nlaunch = "1 us"\nabout = 1\n',
         "s.toml: engine.eager.about: expected a string, got an integer (1)"),
        ('[model]\npreset = "kimi-k2"\n[parameters]\nmoe_efficiency = { value = 0.5, fit = "yes" }\n',
         "s.toml: parameters.moe_efficiency.fit: expected true or false, got a string ('yes')"),
        ('[model]\npreset = "kimi-k2"\n[[anchor]]\nname = "a"\nhardware = "b300"\nwhen = 1\n',
         "s.toml: anchor[0] (a): unknown field(s) when; expected some of block_size, budget"),
        ('title = ["t"]\n[model]\npreset = "kimi-k2"\n', "s.toml: title: expected a string, got a list"),
        ('scenario = [1, 2]\n[model]\npreset = "kimi-k2"\n',
         "s.toml: scenario must be an array of tables ([[scenario]]), got a list"),
        ('mystery = 1\n[model]\npreset = "kimi-k2"\n', "s.toml: unknown field(s) mystery; expected some of anchor"),
    ],
)  # fmt: skip
def test_scenario_errors_name_file_and_field_path(tmp_path, text, message):
    (tmp_path / "s.toml").write_text(text)
    with pytest.raises(ScenarioError) as exc:
        load_scenario(tmp_path / "s.toml")
    assert message in str(exc.value)
    assert str(exc.value).startswith(str(tmp_path / "s.toml"))
    assert "\n" not in str(exc.value) and "pydantic" not in str(exc.value)


@pytest.mark.parametrize(
    "text,message",
    [
        (SOURCE + POINT + 'drafter = { params = 1e9, layers = 1, source = 7 }\n',
         "bad.toml: point[0] (p).drafter.source: expected a string, got an integer (7)"),
        (SOURCE + '[defaults]\ndrafter = { params = 1e9, layers = 1, size = 7 }\n' + POINT,
         "bad.toml: defaults.drafter: unknown field(s) size"),
        (SOURCE + POINT.replace('name = "p"', "name = 1"), "bad.toml: point[0].name: expected a string"),
        ('point = [1]\n' + SOURCE, "bad.toml: point[0] must be a table ([[point]])"),
        (SOURCE + 'title = 3\n' + POINT, "bad.toml: source.title: expected a string"),
    ],
)  # fmt: skip
def test_corpus_errors_name_file_and_field_path(tmp_path, text, message):
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ScenarioError) as exc:
        corpus.load_points(tmp_path)
    assert message in str(exc.value)
