import subprocess
import sys

import pytest

from ddtree.cli import COMMANDS, main


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage: ddtree" in capsys.readouterr().out


def test_every_listed_command_has_a_unique_path():
    paths = [path for path, _, _ in COMMANDS]
    assert len(paths) == len(set(paths))


def test_python_dash_m_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "ddtree", "--help"], capture_output=True, text=True, check=True
    )
    assert "COMMAND" in out.stdout


def test_help_and_light_commands_do_not_import_torch():
    # every command's help line is listed, yet only the named command's module is imported
    code = (
        "import sys\n"
        "from ddtree.cli import build_parser\n"
        "p = build_parser(sys.argv[1:])\n"
        "print(p.format_help())\n"
        "print('torch' in sys.modules)\n"
    )
    for argv in ([], ["estimate"], ["diagnose"]):
        out = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True
        ).stdout
        assert "bench" in out and "train" in out
        assert out.strip().splitlines()[-1] == "False", argv


def test_a_command_named_in_argv_gets_its_arguments_the_others_do_not():
    from ddtree.cli import build_parser

    parser = build_parser(["bench", "tree"])
    assert parser.parse_args(["bench", "tree", "--budgets", "32"]).budgets == [32]
    with pytest.raises(SystemExit):  # bench moe is listed, without its arguments
        parser.parse_args(["bench", "moe", "--repeats", "2"])
    assert build_parser().parse_args(["bench", "moe", "--repeats", "2"]).repeats == 2
