"""``opguard_check_options``: plugins refuse run settings they cannot use before any
stage runs (docs/plugins.md). The built-in basic filter reads its ``--basic-list``
there; a third-party plugin's refusal ends the run the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from click.testing import CliRunner

from opguard_core import hookimpl
from opguard_core.cli.app import create_cli
from opguard_core.errors import InputError
from opguard_core.model import RunOptions
from opguard_core.plugin.manager import create_plugin_manager

SAMPLE = Path(__file__).parent / "data" / "samples" / "gpt_callsite_rank0.json"


def _run(tmp_path: Path, *args: str | Path, plugin: Any = None) -> Any:
    manager = create_plugin_manager()
    if plugin is not None:
        manager.register(plugin, name="test_plugin")
    argv = ["run", "-i", str(SAMPLE), "--output-base", str(tmp_path / "out"), *map(str, args)]
    return CliRunner().invoke(create_cli(manager), argv)


def test_hook_check_options(
    tmp_path: Path,
) -> None:
    """Before: every stage ran, then the filter failed (exit 1, the summary saying the
    entry failed at ``filter``)."""
    listed = tmp_path / "basic.yaml"
    listed.write_text("utilities: [torch.nn.init, \n")
    result = _run(tmp_path, "--basic", "--basic-list", listed)
    assert result.exit_code == 2, result.output
    assert f"{listed}: malformed YAML" in result.output
    assert not (tmp_path / "out").exists()  # nothing written, not even the base
    listed.write_text("utilities: [torch.nn.init]\n")
    assert _run(tmp_path, "--basic", "--basic-list", listed).exit_code == 0


class _NoHide:
    """A third-party plugin that cannot work with ``--hide`` patterns."""

    @hookimpl
    def opguard_check_options(self, options: RunOptions) -> None:
        if options.hide:
            raise InputError("--hide", "this plugin needs every frame")


def test_hook_check_options_lets_a_plugin_refuse_an_option(tmp_path: Path) -> None:
    result = _run(tmp_path, "--hide", "foo", plugin=_NoHide())
    assert result.exit_code == 2, result.output
    assert "--hide: this plugin needs every frame" in result.output
    assert not (tmp_path / "out").exists()
    assert _run(tmp_path, plugin=_NoHide()).exit_code == 0
