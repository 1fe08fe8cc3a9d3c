"""Every command's hidden ``--settings-file``: a command that runs another (ship) hands it an ``Invocation`` as a file
the child reads and checks once, as it would read the same words on its command line; ``spell`` writes the line a
person would type."""

from __future__ import annotations

import json

import pytest
import typer.main
from typer.testing import CliRunner

from bdlora.base.argv import Invocation, option_values
from bdlora.base.errors import UsageError
from bdlora.cli import app
from bdlora.cli.spell import click_command, spell
from bdlora.compress.config import OneShotConfig


def _params(words, args):
    cmd = click_command(words)
    return cmd.make_context(words[-1], list(args)).params


def _write(path, inv: Invocation):
    path.write_text(json.dumps(inv.to_json()))
    return str(path)


def test_a_file_gives_what_its_spelled_line_gives_and_the_command_line_wins(tmp_path):
    inv = Invocation(("bench",), {"model_dir": "D/a", **option_values(OneShotConfig, threads=2),
                                  "also": ["D/b", "D/c"], "peers": False, "genai_precisions": "int4,int8"})
    line = spell(inv)
    assert line == ["bench", "D/a", "--threads", "2", "--also", "D/b", "--also", "D/c", "--no-peers",
                    "--genai-precisions", "int4,int8"]
    by_line = _params(("bench",), line[1:])
    by_file = _params(("bench",), ["--settings-file", _write(tmp_path / "s.json", inv)])
    assert {**by_file, "settings_file": None} == by_line
    assert list(by_file["also"]) == ["D/b", "D/c"] and by_file["peers"] is False and by_file["threads"] == 2
    over = _params(("bench",), ["--settings-file", str(tmp_path / "s.json"), "--threads", "1", "D/z"])
    assert over["threads"] == 1 and over["model_dir"] == "D/z" and list(over["also"]) == ["D/b", "D/c"]


@pytest.mark.parametrize("content,needle", [
    ({"command": ["export", "genai"], "values": {}}, "written for `bdlora export genai`, not `bdlora compress`"),
    ({"command": ["compress"], "values": {"speed_up": "2"}}, "`bdlora compress` has no parameter speed_up"),
    ({"command": ["compress"], "values": {"speedup": {"a": 1}}}, "'values' speedup: {'a': 1} is not a command-line"),
    ({"values": {}}, "'command' None: a list of a command's words"),
    ([1, 2], "not a settings file"),
    ({"command": ["compress"], "values": {"speedup": "fast"}}, "Invalid value for '--speedup'"),
])
def test_a_bad_settings_file_is_one_line_naming_it(tmp_path, content, needle):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(content))
    r = CliRunner().invoke(app, ["compress", "--settings-file", str(path)])
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_a_missing_or_unreadable_file_is_one_line(tmp_path):
    r = CliRunner().invoke(app, ["train", "--settings-file", str(tmp_path / "none.json")])
    assert r.exit_code == 2 and f"{tmp_path / 'none.json'}: cannot read it" in r.output, r.output
    (tmp_path / "bad.json").write_text("{")
    r = CliRunner().invoke(app, ["train", "--settings-file", str(tmp_path / "bad.json")])
    assert r.exit_code == 2 and "bad.json" in r.output and "Traceback" not in r.output, r.output


def test_every_command_takes_it_and_no_help_shows_it():
    root = typer.main.get_command(app)
    commands = [(name,) for name, c in root.commands.items() if not hasattr(c, "commands")]
    commands += [(name, sub) for name, c in root.commands.items() if hasattr(c, "commands") for sub in c.commands]
    assert len(commands) >= 12
    for words in commands:
        cmd = click_command(words)
        assert "settings_file" in {p.name for p in cmd.params}, words
        r = CliRunner().invoke(app, [*words, "--help"])
        assert r.exit_code == 0 and "settings-file" not in r.output, words


def test_spelling_refuses_a_parameter_the_command_lacks():
    with pytest.raises(UsageError, match="`bdlora export gguf` has no parameter precision"):
        spell(Invocation(("export", "gguf"), {"precision": "int4"}))
    with pytest.raises(UsageError, match="no command `bdlora export tflite`"):
        spell(Invocation(("export", "tflite"), {}))


def test_a_file_for_a_command_of_the_same_last_word_elsewhere_is_refused(tmp_path):
    """Under the program, the file's words must be the command's own: ["x", "genai"] is not `bdlora export genai`."""
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"command": ["x", "genai"], "values": {}}))
    r = CliRunner().invoke(app, ["export", "genai", "--settings-file", str(path)])
    assert r.exit_code == 2 and "written for `bdlora x genai`, not `bdlora export genai`" in r.output, r.output
