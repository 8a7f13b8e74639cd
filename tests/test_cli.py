import subprocess
import sys

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
