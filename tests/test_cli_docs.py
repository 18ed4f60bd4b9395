"""Every CLI command has help text and is listed in docs/cli.md."""

from __future__ import annotations

from pathlib import Path

from typer.main import get_command

from mtplx.cli import app

DOC = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()


def test_every_command_is_documented_and_has_help():
    group = get_command(app)
    for name, command in group.commands.items():
        assert f"`mtplx {name}" in DOC, f"mtplx {name} is missing from docs/cli.md"
        assert command.help, f"mtplx {name} has no help text"


def test_models_json_lists_embedded_models(capsys):
    import json

    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0
    names = {row["name"]: row for row in json.loads(result.stdout)}
    assert set(names) == {"tiny-dense", "tiny-hybrid"} and all(r["mtp"] for r in names.values())
    assert all(Path(r["path"]).is_dir() for r in names.values())
