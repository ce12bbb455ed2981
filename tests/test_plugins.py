"""Third-party plugins: the example package, listing, blocking, errors, and every hook.

The example package (``examples/opguard-plugin-example``) is "installed" without
network and without touching the environment: a ``*.dist-info`` directory with
``METADATA`` and ``entry_points.txt`` is written under ``tmp_path``, and that
directory and the example's ``src/`` are put on ``sys.path``, which is all
``importlib.metadata.entry_points()`` needs. Every module the test imports from
there is removed from ``sys.modules`` afterwards.

The ``test_hook_<name>`` tests exercise each hook through the plugin manager;
``tests/test_hooks_documented.py`` insists that each hook has one.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap

from opguard_core import hookimpl
from opguard_core.cli.app import create_cli, main
from opguard_core.combine.accumulator import CallsiteTrace
from opguard_core.errors import ExitCode, PluginError
from opguard_core.formats.config import entry_key, validate_config
from opguard_core.formats.readers import Readers
from opguard_core.formats.tree import check_tree, iter_nodes, load_tree
from opguard_core.model import Discovery, InputEntry, RunOptions
from opguard_core.plugin.manager import (
    ESSENTIAL_PLUGINS,
    EssentialPluginError,
    OpGuardPluginManager,
    create_plugin_manager,
)
from opguard_plugins.stages.combine import combine_files
from tests.builders import trace_doc, write

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "opguard-plugin-example"
EXAMPLE_SRC = EXAMPLE / "src"
EXAMPLE_ENTRY_POINTS = {
    "drop_small": "opguard_plugin_example.drop_small",
    "shallow": "opguard_plugin_example.shallow",
}
EXAMPLE_SETTINGS = (
    "OPGUARD_EXAMPLE_MIN_COUNT",
    "OPGUARD_EXAMPLE_DROP",
    "OPGUARD_EXAMPLE_MAX_DEPTH",
)
#: prefixes of every module the tests import from a temporary site directory
TEMP_MODULE_PREFIXES = ("opguard_plugin_example", "opg_test_")
GPT_TOTAL = 2826 + 2722
BUILTINS = ["basic_filter", "combine", "compare", "compress", "discover", "generate", "merge"]


# ---------------------------------------------------------------------------
# Installing distributions on sys.path
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Site:
    """A temporary site directory on ``sys.path``."""

    path: Path
    monkeypatch: pytest.MonkeyPatch

    def install(
        self,
        name: str,
        entry_points: dict[str, str],
        version: str = "0.1.0",
        modules: dict[str, str] | None = None,
    ) -> None:
        """Write ``{name}-{version}.dist-info`` and, optionally, module sources."""
        info = self.path / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
        )
        lines = ["[opguard]", *(f"{ep} = {target}" for ep, target in entry_points.items())]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        for module, source in (modules or {}).items():
            (self.path / f"{module}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        # a new directory on sys.path: drop importlib's (and importlib.metadata's) caches
        self.monkeypatch.syspath_prepend(str(self.path))

    def plugin(self, name: str, source: str, dist: str | None = None) -> str:
        """Install a one-module plugin ``opg_test_{name}`` as entry point ``name``."""
        module = f"opg_test_{name}"
        self.install(dist or f"opg-test-{name}", {name: module}, modules={module: source})
        return module


def _forget_temp_modules() -> None:
    for module in [m for m in sys.modules if m.startswith(TEMP_MODULE_PREFIXES)]:
        del sys.modules[module]


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Site]:
    monkeypatch.delenv("OPGUARD_DISABLE_PLUGINS", raising=False)
    _forget_temp_modules()
    yield Site(tmp_path / "site", monkeypatch)
    _forget_temp_modules()


@pytest.fixture
def example(site: Site, monkeypatch: pytest.MonkeyPatch) -> Site:
    """The example package, installed as a dist-info with its ``src/`` on sys.path."""
    for variable in (
        "OPGUARD_EXAMPLE_MIN_COUNT",
        "OPGUARD_EXAMPLE_DROP",
        "OPGUARD_EXAMPLE_MAX_DEPTH",
    ):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
    site.install("opguard-plugin-example", EXAMPLE_ENTRY_POINTS)
    return site


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``opguard ARGS`` through the console-script entry point: (exit code, out, err)."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out, err = capsys.readouterr()
    code = exit_info.value.code
    return (code if isinstance(code, int) else 1), out, err


def gpt_inputs(samples: Path) -> list[str]:
    return ["--input", str(samples / "gpt_callsite_rank*.json")]


def stage(summary: dict[str, Any], name: str) -> dict[str, Any]:
    (record,) = [s for s in summary["stages"] if s["stage"] == name]
    return record


def load_yaml(path: Path) -> Any:
    return YAML(typ="safe", pure=True).load(path.read_text())


def label(entry: dict[str, Any]) -> str:
    """How the summary names an entry it dropped."""
    target, context = entry_key(entry)
    return f"{target} [{' > '.join(context)}]" if context else target


# ---------------------------------------------------------------------------
# opguard plugins
# ---------------------------------------------------------------------------


def test_plugins_lists_the_example(opguard, example: Site) -> None:
    text = opguard("plugins", expect=0).result.stdout
    lines = text.splitlines()
    assert len(lines) == 2, text
    assert lines[0].split() == ["drop_small", "opguard-plugin-example", "0.1.0", "opguard_filter"]
    assert lines[1].split() == ["shallow", "opguard-plugin-example", "0.1.0", "opguard_compress"]
    assert not any(line.startswith(("compress ", "basic_filter")) for line in lines)


def test_plugins_json_and_all(opguard, example: Site) -> None:
    listed = json.loads(opguard("plugins", "--json", expect=0).result.stdout)
    assert listed == [
        {
            "name": "drop_small",
            "distribution": "opguard-plugin-example",
            "version": "0.1.0",
            "hooks": ["opguard_filter"],
            "builtin": False,
        },
        {
            "name": "shallow",
            "distribution": "opguard-plugin-example",
            "version": "0.1.0",
            "hooks": ["opguard_compress"],
            "builtin": False,
        },
    ]
    everything = json.loads(opguard("plugins", "--all", "--json", expect=0).result.stdout)
    builtins = {p["name"]: p for p in everything if p["builtin"]}
    assert set(BUILTINS) <= set(builtins)
    assert builtins["compress"]["hooks"] == ["opguard_compress"]
    assert builtins["basic_filter"]["distribution"] == "opguard"
    assert [p["name"] for p in everything if not p["builtin"]] == ["drop_small", "shallow"]
    text = opguard("plugins", "--all", expect=0).result.stdout
    assert any(line.split()[:1] == ["merge"] for line in text.splitlines())


def test_plugins_without_third_party_plugins(opguard, site: Site) -> None:
    text = opguard("plugins", expect=0).result.stdout
    assert "no third-party plugins installed" in text


# ---------------------------------------------------------------------------
# opguard run with the example installed
# ---------------------------------------------------------------------------


def test_run_uses_the_example_filter_and_compressor(opguard, example: Site, samples: Path) -> None:
    run = opguard("run", *gpt_inputs(samples), expect=0)
    assert run.run_dir is not None
    summary = json.loads(run.read("pipeline_summary.json"))

    # the compressor: first result wins over the trylast built-in
    assert stage(summary, "compress")["plugin"] == "shallow"
    tree = load_tree(run.run_dir / "gpt_callsite_compressed.json")
    assert tree["meta"]["compression"]["compressor"] == "shallow"
    assert tree["meta"]["compression"]["max_depth"] == 3
    assert tree["root"]["count"] == GPT_TOTAL
    assert max(_depth(tree["root"])) <= 3
    assert _ran(tree)["aten::_scaled_dot_product_flash_attention_for_cpu"] == {0}

    # the filter runs without --basic, writes the filtered config, and is recorded
    config = load_yaml(run.run_dir / "gpt_callsite_instrumentation.yaml")
    small = [e for e in config["entries"] if e["count"] < 10]
    assert small, "the sample should have entries below the default threshold"
    record = stage(summary, "filter")
    assert record["status"] == "ok"
    assert record["plugin"] == "drop_small"
    assert record["outputs"] == ["gpt_callsite_filtered_instrumentation.yaml"]
    (step,) = record["counts"]["filters"]
    assert step["plugin"] == "drop_small"
    assert step["dropped"] == [label(e) for e in small]
    assert step["entries_before"] == len(config["entries"])
    filtered = load_yaml(run.run_dir / "gpt_callsite_filtered_instrumentation.yaml")
    assert [entry_key(e) for e in filtered["entries"]] == [
        entry_key(e) for e in config["entries"] if e["count"] >= 10
    ]
    assert step["entries_after"] == len(filtered["entries"])
    assert {p["name"] for p in summary["plugins"]} >= {"drop_small", "shallow"}


def _depth(node: dict[str, Any], at: int = 0) -> Iterator[int]:
    yield at
    for child in node["children"]:
        yield from _depth(child, at + 1)


def test_example_settings_come_from_the_environment(
    opguard, example: Site, samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPGUARD_EXAMPLE_MIN_COUNT", "0")
    monkeypatch.setenv("OPGUARD_EXAMPLE_DROP", r"torch\..*")
    monkeypatch.setenv("OPGUARD_EXAMPLE_MAX_DEPTH", "1")
    run = opguard("run", *gpt_inputs(samples), expect=0)
    assert run.run_dir is not None
    tree = load_tree(run.run_dir / "gpt_callsite_compressed.json")
    assert max(_depth(tree["root"])) == 1
    filtered = load_yaml(run.run_dir / "gpt_callsite_filtered_instrumentation.yaml")
    assert filtered["entries"]
    assert not any(e["target"].startswith("torch.") for e in filtered["entries"])

    monkeypatch.setenv("OPGUARD_EXAMPLE_MIN_COUNT", "lots")
    run = opguard("run", *gpt_inputs(samples), expect=int(ExitCode.STAGE_FAILED))
    record = stage(json.loads(run.read("pipeline_summary.json")), "filter")
    assert record["status"] == "failed"
    assert "OPGUARD_EXAMPLE_MIN_COUNT='lots'" in record["error"]


def test_filter_chain_order_third_party_then_basic(opguard, example: Site, samples: Path) -> None:
    """Documented order: tryfirst, then plain filters by name, then trylast (basic) last."""
    example.plugin(
        "aaa_filter",
        """
        from opguard_core import hookimpl

        @hookimpl
        def opguard_filter(config):
            config["entries"] = [e for e in config["entries"] if e["kind"] != "method"]
            return config
        """,
    )
    run = opguard("run", *gpt_inputs(samples), "--basic", expect=0)
    summary = json.loads(run.read("pipeline_summary.json"))
    record = stage(summary, "filter")
    chain = record["counts"]["filters"]
    assert [step["plugin"] for step in chain] == ["aaa_filter", "drop_small", "basic_filter"]
    assert record["plugin"] == "aaa_filter,drop_small,basic_filter"
    for before, after in itertools.pairwise(chain):
        assert after["entries_before"] == before["entries_after"]
    config = load_yaml(run.run_dir / "gpt_callsite_instrumentation.yaml")
    methods = [label(e) for e in config["entries"] if e["kind"] == "method"]
    assert chain[0]["dropped"] == methods
    assert record["counts"]["entries"] == chain[-1]["entries_after"]


def _ran(tree: dict[str, Any]) -> dict[str, set[int]]:
    """Which ranks ran each op, over the whole tree (tree version 6)."""
    assert tree["meta"]["op_ranks"] is True
    ran: dict[str, set[int]] = {}
    for node, parent in iter_nodes(tree["root"]):
        mine = node["ranks"] if parent is not None else tree["meta"]["ranks"]
        for op in node["self_ops"]:
            ran.setdefault(op, set()).update(node.get("self_op_ranks", {}).get(op, mine))
    return ran


def test_the_example_compressor_keeps_which_ranks_ran_an_op(example: Site, tmp_path: Path) -> None:
    """``shallow`` folds a node below its depth into its ancestor with the ranks that
    ran each op: ``aten::exp``, which rank 0 alone ran five levels down where both
    ranks ran ``aten::mm``, is still rank 0's (else check would hold rank 1 to it)."""
    from opguard_plugin_example.shallow import opguard_compress

    stack = [("job", name) for name in ("main", "train", "step", "log", "metrics")]
    for rank in (0, 1):
        sites = [(stack, None, "aten::mm", 40)]
        if rank == 0:
            sites.append((stack, None, "aten::exp", 8))
        write(tmp_path / f"j_callsite_rank{rank}.json", trace_doc(sites, rank=rank, world_size=2))
    trace = combine_files(sorted(tmp_path.glob("j_callsite_rank*.json"))).result()
    tree = opguard_compress(trace=trace, options=RunOptions(chains=False))
    check_tree(tree, expected_total=trace.total)
    assert max(_depth(tree["root"])) == 3
    assert _ran(tree) == {"aten::mm": {0, 1}, "aten::exp": {0}}


def test_compressor_by_name(opguard, example: Site, samples: Path) -> None:
    run = opguard("run", *gpt_inputs(samples), "--compressor", "compress", expect=0)
    assert stage(json.loads(run.read("pipeline_summary.json")), "compress")["plugin"] == "compress"
    assert run.run_dir is not None
    tree = load_tree(run.run_dir / "gpt_callsite_compressed.json")
    assert tree["meta"]["compression"]["compressor"] == "compress"
    assert max(_depth(tree["root"])) > 3

    run = opguard("run", *gpt_inputs(samples), "--compressor", "shallow", expect=0)
    assert stage(json.loads(run.read("pipeline_summary.json")), "compress")["plugin"] == "shallow"

    refused = opguard("run", *gpt_inputs(samples), "--compressor", "drop_small", expect=2)
    assert "--compressor drop_small: no such compressor plugin" in refused.stderr


@pytest.mark.parametrize("how", ["option", "environment"])
def test_disabled_example_is_never_imported(
    how: str, opguard, example: Site, samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args: list[str] = []
    if how == "option":
        args = ["--disable-plugin", "drop_small", "--disable-plugin=shallow"]
    else:
        monkeypatch.setenv("OPGUARD_DISABLE_PLUGINS", "drop_small, shallow")
    run = opguard("run", *gpt_inputs(samples), *args, expect=0)
    assert run.run_dir is not None
    for module in EXAMPLE_ENTRY_POINTS.values():
        assert module not in sys.modules
    summary = json.loads(run.read("pipeline_summary.json"))
    assert summary["disabled_plugins"] == ["drop_small", "shallow"]
    assert stage(summary, "compress")["plugin"] == "compress"
    assert "filter" not in {s["stage"] for s in summary["stages"]}
    assert not (run.run_dir / "gpt_callsite_filtered_instrumentation.yaml").exists()
    listing = opguard("plugins", *args, expect=0).result.stdout
    assert "opguard-plugin-example" not in listing
    assert "disabled: drop_small, shallow" in listing


def test_disabling_one_example_plugin_keeps_the_other(
    opguard, example: Site, samples: Path
) -> None:
    run = opguard("run", *gpt_inputs(samples), "--disable-plugin", "drop_small", expect=0)
    assert "opguard_plugin_example.drop_small" not in sys.modules
    summary = json.loads(run.read("pipeline_summary.json"))
    assert stage(summary, "compress")["plugin"] == "shallow"
    assert "filter" not in {s["stage"] for s in summary["stages"]}


def test_a_disabled_optional_stage_is_skipped_not_failed(opguard, samples: Path) -> None:
    """The divergence stage is a plugin's: disabled, the run skips it and says why."""
    run = opguard("--disable-plugin", "divergence", "run", *gpt_inputs(samples), expect=0)
    summary = json.loads(run.read("pipeline_summary.json"))
    record = stage(summary, "divergence")
    assert record["status"] == "skipped"
    assert record["error"] == "no plugin implements opguard_divergence (disabled)"
    assert summary["status"] == "ok"
    assert not list(run.run_dir.glob("*_divergence.*"))


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["option", "environment"])
def test_disabling_an_essential_plugin_is_a_usage_error(
    how: str, site: Site, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["plugins"]
    if how == "option":
        args = ["--disable-plugin", "compress", "plugins"]
    else:
        monkeypatch.setenv("OPGUARD_DISABLE_PLUGINS", "merge")
    code, _, err = run_main(args, capsys)
    assert code == ExitCode.USAGE_ERROR == 2
    name = "compress" if how == "option" else "merge"
    assert f"opguard: error: cannot disable essential built-in plugin(s) {name}" in err
    assert "--skip STAGE" in err
    with pytest.raises(EssentialPluginError):
        create_plugin_manager([name])
    assert name in ESSENTIAL_PLUGINS


def test_basic_filter_and_trace_may_be_disabled(site: Site) -> None:
    manager = create_plugin_manager(["basic_filter", "trace"])
    assert manager.disabled == ["basic_filter", "trace"]
    assert manager.get_plugin("basic_filter") is None
    assert manager.implementations("opguard_filter") == []


MISSPELT = """
    from opguard_core import hookimpl

    @hookimpl
    def opguard_filtr(config):
        return config
"""

MISSPELT_UNMARKED = """
    def opguard_compres(trace, options):
        return None
"""

WRONG_ARGS = """
    from opguard_core import hookimpl

    @hookimpl
    def opguard_filter(cfg, options):
        return cfg
"""


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (MISSPELT, "unknown hook 'opguard_filtr' (did you mean opguard_filter?)"),
        (MISSPELT_UNMARKED, "unknown hook 'opguard_compres' (did you mean opguard_compress?)"),
        (
            WRONG_ARGS,
            "opguard_filter(cfg, options): unknown argument(s) cfg;"
            " opguard_filter takes config, options",
        ),
    ],
    ids=["misspelt", "misspelt-unmarked", "wrong-arguments"],
)
def test_invalid_plugin_is_named(
    source: str, expected: str, site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    site.plugin("sloppy", source)
    with pytest.raises(PluginError) as error:
        create_plugin_manager()
    assert str(error.value).startswith('plugin "sloppy": ')
    assert expected in str(error.value)
    assert "\n" not in str(error.value)
    code, _, err = run_main(["plugins"], capsys)
    assert code == ExitCode.PLUGIN_ERROR == 3
    assert err.startswith('opguard: error: plugin "sloppy": ')
    assert expected in err


def test_plugin_that_fails_to_import_is_named(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    site.plugin("broken", "import opguard_no_such_module\n")
    with pytest.raises(PluginError, match=r'^Error importing plugin "broken": No module named'):
        create_plugin_manager()
    code, _, err = run_main(["run", "--input", "x.json"], capsys)
    assert code == 3
    assert 'opguard: error: Error importing plugin "broken": No module named \'opguard_no' in err


def test_a_broken_plugin_can_be_disabled(site: Site, capsys: pytest.CaptureFixture[str]) -> None:
    site.plugin("broken", "raise RuntimeError('boom')\n")
    code, out, _ = run_main(["--disable-plugin", "broken", "plugins"], capsys)
    assert code == 0
    assert "disabled: broken" in out
    assert "opg_test_broken" not in sys.modules


def test_unmarked_opguard_function_is_a_hook(site: Site) -> None:
    site.plugin(
        "unmarked",
        """
        def opguard_filter(config):
            config["entries"] = []

        def helper():
            return 1
        """,
    )
    manager = create_plugin_manager()
    assert [i.plugin_name for i in manager.implementations("opguard_filter")] == [
        "unmarked",
        "basic_filter",
    ]
    (info,) = [p for p in manager.describe() if p.name == "unmarked"]
    assert (info.distribution, info.version, info.hooks) == (
        "opg-test-unmarked",
        "0.1.0",
        ["opguard_filter"],
    )


# ---------------------------------------------------------------------------
# One test per hook, through the plugin manager
# ---------------------------------------------------------------------------


@pytest.fixture
def pm(site: Site) -> OpGuardPluginManager:
    """The built-ins (and anything installed in the environment), loaded from entry points."""
    return create_plugin_manager()


def _entry(pm: OpGuardPluginManager, samples: Path, name: str = "gpt") -> InputEntry:
    found = pm.hook.opguard_discover(inputs=[f"{name}_callsite_rank*.json"], base_dir=samples)
    return found.entries[0]


def _config(pm: OpGuardPluginManager, samples: Path, name: str = "gpt") -> CommentedMap:
    options = RunOptions()
    trace = pm.hook.opguard_combine(
        entry=_entry(pm, samples, name), options=options, readers=Readers(pm)
    )
    tree = pm.hook.opguard_compress(trace=trace, options=options)
    config: CommentedMap = pm.hook.opguard_generate(
        tree=tree, source=f"{name}_callsite", options=options
    )
    return config


def test_hook_discover(pm: OpGuardPluginManager, samples: Path) -> None:
    found = pm.hook.opguard_discover(
        inputs=["gpt_callsite_rank*.json", "missing.json"], base_dir=samples
    )
    assert isinstance(found, Discovery)
    (entry,) = found.entries
    assert entry.name == "gpt_callsite"
    assert entry.index == 1
    assert [f.name for f in entry.files] == ["gpt_callsite_rank0.json", "gpt_callsite_rank1.json"]
    assert [p.spec for p in found.problems] == ["missing.json"]

    class OneEntry:
        """A discoverer that ignores patterns: first result wins over the built-in."""

        @hookimpl
        def opguard_discover(self, inputs: list[str], base_dir: Path) -> Discovery:
            files = tuple(sorted(base_dir.glob("fsdp_*.json")))
            return Discovery([InputEntry("everything", files, 1, tuple(inputs))])

    pm.register(OneEntry(), name="one_entry")
    found = pm.hook.opguard_discover(inputs=["gpt_callsite_rank*.json"], base_dir=samples)
    assert [e.name for e in found.entries] == ["everything"]
    assert len(found.entries[0].files) == 2


def test_hook_combine(pm: OpGuardPluginManager, samples: Path) -> None:
    entry = _entry(pm, samples)
    trace = pm.hook.opguard_combine(entry=entry, options=RunOptions(), readers=Readers(pm))
    assert isinstance(trace, CallsiteTrace)
    assert trace.ranks == [0, 1]
    assert trace.total == GPT_TOTAL
    assert all(max(site.stack, default=0) < len(trace.frames) for site in trace.callsites)

    seen: list[str] = []

    class Executor:
        """Like an executor plugin: returns None (hands over) unless chosen."""

        @hookimpl
        def opguard_combine(self, entry: InputEntry, options: RunOptions) -> None:
            seen.append(f"{entry.name}:{options.executor}")

    pm.register(Executor(), name="executor")
    again = pm.hook.opguard_combine(entry=entry, options=RunOptions(), readers=Readers(pm))
    assert seen == ["gpt_callsite:local"]
    assert again.total == GPT_TOTAL


def test_hook_compress(
    pm: OpGuardPluginManager, samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = pm.hook.opguard_combine(
        entry=_entry(pm, samples), options=RunOptions(), readers=Readers(pm)
    )
    tree = pm.hook.opguard_compress(trace=trace, options=RunOptions(min_count=50))
    check_tree(tree, expected_total=trace.total)
    assert tree["meta"]["compression"]["min_count"] == 50
    assert all(node["count"] >= 50 for node, parent in iter_nodes(tree["root"]) if parent)
    assert "compressor" not in tree["meta"]["compression"]

    monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
    from opguard_plugin_example import shallow

    pm.register(shallow, name="shallow")
    monkeypatch.setenv("OPGUARD_EXAMPLE_MAX_DEPTH", "2")
    tree = pm.hook.opguard_compress(trace=trace, options=RunOptions())
    check_tree(tree, expected_total=trace.total)
    assert tree["meta"]["compression"]["compressor"] == "shallow"
    assert max(_depth(tree["root"])) == 2


def test_hook_generate(pm: OpGuardPluginManager, samples: Path) -> None:
    config = _config(pm, samples)
    validate_config(config, "generated")
    assert isinstance(config, CommentedMap)
    assert config["source"] == "gpt_callsite"
    assert config["meta"]["total"] == GPT_TOTAL
    assert config["entries"]
    for entry in config["entries"]:
        assert entry["count"] == sum(entry["ops"].values()) == sum(entry["stream_counts"].values())
    top = [e for e in config["entries"] if not e.get("context")]
    assert sum(e["count"] for e in top) <= GPT_TOTAL


def test_hook_compare(pm: OpGuardPluginManager, samples: Path) -> None:
    gpt, fsdp = _config(pm, samples, "gpt"), _config(pm, samples, "fsdp")
    text = pm.hook.opguard_compare(
        first=gpt, other=fsdp, first_label="1 (gpt_callsite)", other_label="2 (fsdp_callsite)"
    )
    assert text.startswith("comparison: 1 (gpt_callsite) vs 2 (fsdp_callsite)\n")
    only_gpt = {entry_key(e) for e in gpt["entries"]} - {entry_key(e) for e in fsdp["entries"]}
    assert f"only in 1 (gpt_callsite): {len(only_gpt)}" in text
    same = pm.hook.opguard_compare(first=gpt, other=gpt, first_label="a", other_label="b")
    assert "changed: 0" in same


def test_hook_merge(pm: OpGuardPluginManager, samples: Path) -> None:
    config = _config(pm, samples)
    counts = {entry_key(e): e["count"] for e in config["entries"]}
    merged = pm.hook.opguard_merge(left=copy.deepcopy(config), right=copy.deepcopy(config))
    validate_config(merged, "merged")
    assert {entry_key(e): e["count"] for e in merged["entries"]} == {
        key: 2 * count for key, count in counts.items()
    }
    keys = [entry_key(e) for e in merged["entries"]]
    assert keys == sorted(keys)


def test_hook_filter(pm: OpGuardPluginManager, samples: Path) -> None:
    config = _config(pm, samples)
    before = len(config["entries"])
    # not firstresult: every implementation's (non-None) result comes back as a list
    results = pm.hook.opguard_filter(config=config, options=RunOptions(basic=True))
    assert len(results) == 1
    (filtered,) = results
    assert 0 < len(filtered["entries"]) < before
    assert {e["kind"] for e in filtered["entries"]} <= {"function", "method"}
    assert not any(e["target"] in ("torch:cat", "torch:Tensor.view") for e in filtered["entries"])

    class First:
        @hookimpl(tryfirst=True)
        def opguard_filter(self, config: CommentedMap) -> None:
            config["entries"] = config["entries"][:1]

    class Plain:
        @hookimpl
        def opguard_filter(self, config: CommentedMap) -> CommentedMap:
            return config

    pm.register(Plain(), name="plain")
    pm.register(First(), name="first")
    # the runner's chain order: tryfirst, then plain, then the trylast built-in
    assert [i.plugin_name for i in pm.implementations("opguard_filter")] == [
        "first",
        "plain",
        "basic_filter",
    ]


def test_hook_register_commands(pm: OpGuardPluginManager) -> None:
    class Hello:
        @hookimpl
        def opguard_register_commands(self, cli: click.Group) -> None:
            @cli.command()
            @click.argument("who")
            def hello(who: str) -> None:
                """Say hello."""
                click.echo(f"hello {who}")

    pm.register(Hello(), name="hello")
    cli = create_cli(pm)
    assert {"run", "plugins", "trace", "hello"} <= set(cli.commands)
    result = CliRunner().invoke(cli, ["hello", "opguard"], catch_exceptions=False)
    assert result.exit_code == 0
    assert result.stdout == "hello opguard\n"


# ---------------------------------------------------------------------------
# Plugin registration in code
# ---------------------------------------------------------------------------


def test_register_names_the_plugin_on_wrong_arguments(pm: OpGuardPluginManager) -> None:
    class Wrong:
        @hookimpl
        def opguard_merge(self, a: Any, b: Any) -> None:
            return None

    with pytest.raises(PluginError, match=r'^plugin "wrong": opguard_merge\(a, b\): unknown'):
        pm.register(Wrong(), name="wrong")
    assert pm.get_plugin("wrong") is None

    class Defaults:
        """Arguments with defaults are not passed (as in pluggy), so they are allowed."""

        @hookimpl
        def opguard_merge(self, left: Any, right: Any, strict: bool = False) -> None:
            return None

    assert pm.register(Defaults(), name="defaults") == "defaults"


def test_one_module_under_two_entry_point_names_is_refused(site: Site) -> None:
    site.install("opg-test-twice", {"one": "opg_test_twice", "two": "opg_test_twice"})
    (site.path / "opg_test_twice.py").write_text("def opguard_filter(config):\n    pass\n")
    with pytest.raises(PluginError, match=r'^plugin "one": already registered as plugin "two"$'):
        create_plugin_manager()


# ---------------------------------------------------------------------------
# The minimal plugin package in docs/plugins.md works as written
# ---------------------------------------------------------------------------


def _docs_block(text: str, after: str, language: str) -> str:
    start = text.index(f"```{language}\n", text.index(after)) + len(language) + 4
    return text[start : text.index("```", start)]


def test_minimal_plugin_package_in_the_docs(
    opguard, site: Site, samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = (EXAMPLE.parent.parent / "docs" / "plugins.md").read_text(encoding="utf-8")
    project = tomllib.loads(_docs_block(docs, "`pyproject.toml`:", "toml"))
    source = _docs_block(docs, "`opguard_drop_modules.py`:", "python")
    (module,) = project["tool"]["setuptools"]["py-modules"]
    site.install(
        project["project"]["name"],
        project["project"]["entry-points"]["opguard"],
        version=project["project"]["version"],
        modules={module: source},
    )
    listing = opguard("plugins", expect=0).result.stdout.split()
    assert listing == ["drop_modules", "opguard-drop-modules", "0.1.0", "opguard_filter"]
    monkeypatch.setenv("DROP_MODULES", "torch.autograd.profiler,ref_workloads")
    run = opguard("run", *gpt_inputs(samples), expect=0)
    assert run.run_dir is not None
    config = load_yaml(run.run_dir / "gpt_callsite_instrumentation.yaml")
    gone = [
        e
        for e in config["entries"]
        if e["target"].split(":")[0] in ("torch.autograd.profiler", "ref_workloads")
    ]
    assert gone
    (step,) = stage(json.loads(run.read("pipeline_summary.json")), "filter")["counts"]["filters"]
    assert step["plugin"] == "drop_modules"
    assert step["dropped"] == [label(e) for e in gone]


def test_opguard_filter_runs_installed_filters_as_the_run_does(
    opguard, example: Site, samples: Path, tmp_path: Path
) -> None:
    run = opguard("run", *gpt_inputs(samples), "--basic", expect=0)
    events = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
    (plugins,) = [e for e in events if e["event"] == "plugins"]
    assert "drop_small (opguard-plugin-example 0.1.0)" in plugins["active"]
    assert "compress" in plugins["active"]
    out = tmp_path / "filtered.yaml"
    command = opguard("filter", run.run_dir, "--basic", "-o", out, expect=0)
    assert command.result.stdout.strip() == str(out)
    assert (
        out.read_bytes()
        == (run.run_dir / "gpt_callsite_filtered_instrumentation.yaml").read_bytes()
    )
    assert load_yaml(out)["meta"]["settings"]["filters"] == ["drop_small", "basic_filter"]


def test_check_of_a_configs_own_traces_is_clean_with_a_count_filter(
    opguard, example: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``drop_small`` drops entries below a count: the config's (two ranks') counts.
    check filters a job's observed config, not each rank's (whose counts are half:
    entries above the threshold in the config fell below it per rank, and check said
    they never ran)."""
    monkeypatch.setenv("OPGUARD_DISABLE_PLUGINS", "shallow")
    traces = str(Path(__file__).resolve().parent.parent / "examples/traces/ddp_callsite_rank*.json")
    run = opguard("run", "--input", traces, expect=0)
    checked = opguard("check", "--config", run.run_dir, "-i", traces, "--format", "json")
    assert checked.exit_code == 0, checked.stderr
    kinds = [v["kind"] for v in json.loads(checked.result.stdout)["violations"]]
    assert "missing" not in kinds, kinds


def test_check_says_when_its_filters_are_not_the_configs(
    opguard, example: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config filtered by ``drop_small``, checked where it is disabled: the report's
    notes say so (check ran another pipeline without a word)."""
    monkeypatch.setenv("OPGUARD_DISABLE_PLUGINS", "shallow")
    traces = str(Path(__file__).resolve().parent.parent / "examples/traces/ddp_callsite_rank*.json")
    run = opguard("run", "--input", traces, expect=0)
    same = opguard("check", "--config", run.run_dir, "-i", traces, "--format", "json")
    assert not any("filtered by" in n for n in json.loads(same.result.stdout).get("notes", []))
    monkeypatch.setenv("OPGUARD_DISABLE_PLUGINS", "shallow,drop_small")
    other = opguard("check", "--config", run.run_dir, "-i", traces, "--format", "json")
    notes = json.loads(other.result.stdout)["notes"]
    assert any(
        n.startswith("the config was filtered by drop_small, the traces are by no filter")
        for n in notes
    ), notes


def test_check_of_a_merged_runs_traces_is_clean_with_a_count_filter(
    opguard, example: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merged run filtered the sum of its jobs: an entry of 6 ops in each job (below
    ``drop_small``'s 10) is kept at 12; checking one job's traces keeps it too (it was
    said to have never ran)."""
    monkeypatch.setenv("OPGUARD_DISABLE_PLUGINS", "shallow")
    examples = Path(__file__).resolve().parent.parent / "examples" / "traces"
    ddp, fsdp = (str(examples / f"{name}_callsite_rank*.json") for name in ("ddp", "fsdp"))
    run = opguard("run", "--input", ddp, "--input", fsdp, expect=0)
    checked = opguard("check", "--config", run.run_dir, "-i", ddp, "--format", "json")
    assert checked.exit_code == 0, checked.stderr
    kinds = [v["kind"] for v in json.loads(checked.result.stdout)["violations"]]
    assert "missing" not in kinds, kinds


_RULE = """
from opguard_core import hookimpl

@hookimpl
def opguard_check_entry(observed, expected, check):
    {body}
"""


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("raise SystemExit(0)",
         "SystemExit(0) raised by plugin rule: a plugin may not end the process"),
        ('return "not a list"',
         'plugin "rule": opguard_check_entry returned str, not a list of Violation'),
        ('return [{"kind": "x"}]',
         'plugin "rule": opguard_check_entry returned a list holding other types, not a list'),
    ],
    ids=["system-exit", "a-string", "dicts"],
)  # fmt: skip
def test_a_check_rule_that_misbehaves_is_named(
    body: str, expected: str, site: Site, samples: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rule raising ``SystemExit(0)`` ended ``opguard check`` with exit 0 and no
    output; one returning something else than violations gave a traceback."""
    config = Path(__file__).parent / "data" / "configs" / "gpt_callsite_v1.yaml"
    site.plugin("rule", _RULE.format(body=body))
    code, _, err = run_main(["check", "--config", str(config), *gpt_inputs(samples)], capsys)
    assert code == ExitCode.PLUGIN_ERROR
    assert f"opguard: error: {expected}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("where", ["at import", "in a reader"])
def test_a_plugin_raising_system_exit_is_named(
    where: str, site: Site, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plugin module raising ``SystemExit(0)`` at import, or a reader raising it,
    ended the command with exit 0 having done nothing."""
    source = (
        "raise SystemExit(0)\n"
        if where == "at import"
        else "from opguard_core import hookimpl\n\n@hookimpl(tryfirst=True)\n"
        "def opguard_read_trace(path, data):\n    raise SystemExit(0)\n"
    )
    site.plugin("quitter", source)
    trace = tmp_path / "k_rank0.json"
    trace.write_text('{"traceEvents": []}')
    code, _, err = run_main(["export", str(trace), "--format", "collapsed"], capsys)
    assert code == ExitCode.PLUGIN_ERROR
    assert "SystemExit(0) raised" in err and "quitter" in err
    assert "a plugin may not end the process" in err
    assert not list(tmp_path.glob("k_rank0*.folded"))


@pytest.mark.parametrize("marker", ["wrapper=True", "hookwrapper=True"])
def test_a_wrapper_implementation_is_refused(
    marker: str, site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrapper was accepted and listed by ``opguard plugins``, then never called."""
    site.plugin(
        "wrap",
        f"from opguard_core import hookimpl\n\n@hookimpl({marker})\n"
        "def opguard_generate(tree, source, options):\n    config = yield\n    return config\n",
    )
    with pytest.raises(PluginError, match=r'^plugin "wrap": opguard_generate: a wrapper'):
        create_plugin_manager()
    code, _, err = run_main(["plugins"], capsys)
    assert code == ExitCode.PLUGIN_ERROR
    assert 'opguard: error: plugin "wrap": opguard_generate: a wrapper implementation' in err


def test_check_compresses_with_the_config_s_compressor(
    opguard, example: Site, samples: Path
) -> None:
    """A config made by ``shallow`` checked with ``shallow`` disabled was compared
    with trees made by the built-in compressor: 63 false ``missing`` warnings on the
    config's own traces (errors under ``--strict``), and no word of the compressor."""
    run = opguard("run", *gpt_inputs(samples), expect=0)
    config = run.run_dir / "gpt_callsite_filtered_instrumentation.yaml"
    assert load_yaml(config)["meta"]["settings"]["compressor"] == "shallow"
    same = opguard("check", "--config", config, *gpt_inputs(samples), expect=0)
    assert ": 0 error(s)" in same.result.stdout
    missing = opguard("--disable-plugin", "shallow", "check", "--config", config,
                      *gpt_inputs(samples), expect=ExitCode.PLUGIN_ERROR)  # fmt: skip
    assert (
        f'opguard: error: {config}: made by compressor plugin "shallow", which is not '
        "installed or is disabled here" in missing.stderr
    )
