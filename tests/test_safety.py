"""Safety (issue 5, part 5): safe YAML loading, no writes outside the run directory,
distinct run directories for runs in the same second, plugins only from entry points."""

from __future__ import annotations

import ast
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

import opguard_core.run.stale as stale_runs
from opguard_core import ENTRY_POINT_GROUP
from opguard_core.errors import InputError, OpGuardError
from opguard_core.files.atomic import create_run_directory, safe_child
from opguard_core.formats.config import dump_config, load_config
from opguard_core.plugin.manager import BUILTIN_PLUGINS, create_plugin_manager
from opguard_plugins.stages.basic_filter import load_basic_list
from opguard_plugins.stages.merge import merge_configs

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "tests" / "data" / "samples" / "gpt_callsite_rank0.json"

# ----------------------------------------------------------------------------- YAML


def _payloads(marker: Path) -> list[str]:
    cmd = f"touch {marker}"
    apply = "!!python/object/apply:os.system"
    return [
        f'version: 1\nentries: !!python/object/apply:os.system ["{cmd}"]\n',
        f'version: 1\nentries:\n  - target: !!python/object/apply:os.system ["{cmd}"]\n',
        f'version: 1\nentries:\n  - target: a\n    file: {apply} ["{cmd}"]\n',
        f'version: 1\nentries:\n  - target: a\n    note: {apply} ["{cmd}"]\n',
        f'version: 1\nmeta: !!python/object/apply:os.system ["{cmd}"]\nentries: []\n',
        f'version: 1\nx: !!python/object/new:subprocess.Popen [["touch", "{marker}"]]\n'
        "entries: []\n",
        "version: 1\nentries:\n  - target: a\n    note: !!python/name:os.system\n",
    ]


@pytest.mark.parametrize("index", range(7))
def test_config_with_python_tags_is_never_executed(tmp_path: Path, index: int) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil_instrumentation.yaml"
    path.write_text(_payloads(marker)[index])
    try:
        config = load_config(path)
    except InputError as exc:
        assert str(path) in str(exc)
    else:
        # loaded as plain data: it can be merged and dumped, and still nothing runs
        plain = {"version": 1, "source": "b", "meta": {"ranks": [0], "total": 0}, "entries": []}
        text = dump_config(merge_configs(config, plain))  # type: ignore[arg-type]
        assert "python/" in text  # carried as inert text, not as an object
    assert not marker.exists()


@pytest.mark.parametrize("index", range(7))
def test_basic_list_with_python_tags_is_refused(tmp_path: Path, index: int) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "list.yaml"
    path.write_text(_payloads(marker)[index].replace("entries", "utilities"))
    with pytest.raises(InputError):
        load_basic_list(path)
    assert not marker.exists()


def _yaml_calls(tree: ast.AST) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name | ast.Attribute)
        and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) == "YAML"
    ]


def test_every_yaml_loader_in_the_code_is_safe_or_round_trip() -> None:
    sources = sorted([*ROOT.glob("opguard_core/**/*.py"), *ROOT.glob("opguard_plugins/**/*.py")])
    calls = 0
    for source in sources:
        text = source.read_text()
        assert "import yaml" not in text, f"{source.name} imports PyYAML"
        assert "unsafe_load" not in text and "full_load" not in text, source.name
        for call in _yaml_calls(ast.parse(text)):
            calls += 1
            typ = {k.arg: k.value for k in call.keywords}.get("typ")
            assert isinstance(typ, ast.Constant), f"{source.name}:{call.lineno}: YAML() without typ"
            assert typ.value in ("safe", "rt"), f"{source.name}:{call.lineno}: typ={typ.value!r}"
    assert calls >= 2  # config_format and the basic filter


# ----------------------------------------------------------------------------- run directory


def _all_files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() or p.is_symlink()}


HOSTILE_NAMES = [
    "..json",
    "...json",
    "...._rank0.json",
    ".._rank1.json",
    "..._rank0.json",
    ".hidden_rank0.json",
    "name with spaces_rank0.json",
    "ünïcødé 名前_rank0.json",
    "final_combined_rank0.json",
    "pipeline_summary.json",
    "-rf.json",
    "a\nnewline.json",
    "x" * 200 + ".json",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=[repr(n)[1:20] for n in HOSTILE_NAMES])
def test_no_input_name_writes_outside_the_run_directory(
    opguard: Callable[..., Any], tmp_path: Path, name: str
) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    shutil.copy(SAMPLE, inputs / name)
    before = _all_files(tmp_path)
    run = opguard("run", "--base-dir", inputs, "-i", name, "--basic")
    assert run.run_dir is not None
    assert run.exit_code == 0, run.stderr
    new = _all_files(tmp_path) - before
    run_dir = run.run_dir.resolve()
    assert new, "the run wrote nothing"
    for path in new:
        assert path.resolve().parent == run_dir, f"{path} written outside {run_dir}"
    names = {p.name for p in new}
    assert "pipeline_summary.json" in names
    produced = [n for n in names if n.endswith("_instrumentation.yaml")]
    assert len(produced) == 2  # the entry's config and the filtered one
    for artifact in names:
        assert not artifact.startswith("."), artifact
        assert "/" not in artifact and "\n" not in artifact


def test_a_very_long_input_name_is_still_processed(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    name = "y" * 240 + "_rank0.json"
    shutil.copy(SAMPLE, tmp_path / name)
    run = opguard("run", "--base-dir", tmp_path, "-i", name)
    assert run.exit_code == 0, run.stderr
    assert any(run.run_dir.glob("*_instrumentation.yaml"))


def test_dot_dot_inside_an_input_path_stays_inside(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    shutil.copy(SAMPLE, tmp_path / "a" / "up_rank0.json")
    link = tmp_path / "a" / "b" / "..x_rank1.json"
    link.symlink_to(tmp_path / "a" / "up_rank0.json")
    before = _all_files(tmp_path)
    run = opguard(
        "run",
        "--base-dir",
        tmp_path / "a" / "b",
        "-i",
        "../up_rank0.json",
        "-i",
        "..x_rank1.json",
        "-i",
        "../b/../../a/*.json",
        expect=0,
    )
    for path in _all_files(tmp_path) - before:
        assert path.resolve().parent == run.run_dir.resolve()


@pytest.mark.parametrize(
    "filename", ["", ".", "..", "../x.json", "a/b.json", "a\\b.json", "/etc/passwd"]
)
def test_safe_child_refuses_names_that_leave_the_directory(tmp_path: Path, filename: str) -> None:
    with pytest.raises(OpGuardError):
        safe_child(tmp_path, filename)


def test_safe_child_refuses_a_symlink_leading_out(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "escape.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(OpGuardError):
        safe_child(tmp_path / "run", "escape.json")


def test_two_run_directories_in_the_same_second_differ(tmp_path: Path) -> None:
    now = dt.datetime(2024, 5, 6, 7, 8, 9)
    first = create_run_directory(tmp_path, now)
    second = create_run_directory(tmp_path, now)
    third = create_run_directory(tmp_path, now)
    assert first.name == "preprocessing_20240506_070809"
    assert len({first, second, third}) == 3
    assert all(p.is_dir() and p.parent == tmp_path for p in (first, second, third))


def test_concurrent_run_directories_never_collide(tmp_path: Path) -> None:
    now = dt.datetime(2024, 5, 6, 7, 8, 9)
    made: list[Path] = []
    lock = threading.Lock()

    def make() -> None:
        for _ in range(5):
            path = create_run_directory(tmp_path, now)
            with lock:
                made.append(path)

    threads = [threading.Thread(target=make) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 40 and len(set(made)) == 40


def test_two_cli_runs_in_the_same_second_get_different_directories(
    opguard: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    frozen = dt.datetime(2024, 5, 6, 7, 8, 9)
    real = stale_runs.create_run_directory

    def create(base: Path, now: dt.datetime | None = None) -> Path:
        return real(base, frozen)

    monkeypatch.setattr(stale_runs, "create_run_directory", create)
    first = opguard("run", "-i", SAMPLE, expect=0)
    second = opguard("run", "-i", SAMPLE, expect=0)
    assert first.run_dir != second.run_dir
    assert first.run_dir.name == "preprocessing_20240506_070809"
    assert second.run_dir.name.startswith("preprocessing_20240506_070809_")
    for run in (first, second):
        summary = json.loads(run.read("pipeline_summary.json"))
        assert summary["run_dir"] == str(run.run_dir.resolve())
        assert (run.run_dir / "gpt_callsite_instrumentation.yaml").is_file()


# ----------------------------------------------------------------------------- plugins

EVIL_PLUGIN = """
from pathlib import Path
Path({marker!r}).write_text("imported")
from opguard_core import hookimpl

@hookimpl(tryfirst=True)
def opguard_filter(config, options):
    Path({marker!r}).write_text("called")
    config["entries"][:] = []
    return config
"""


def _plant_fake_plugins(directory: Path, marker: Path) -> None:
    code = EVIL_PLUGIN.format(marker=str(marker))
    for module in ("opguard_evil", "opguard_plugin_evil", "opguard_filter"):
        (directory / f"{module}.py").write_text(code)
    package = directory / "opguard_plugins"
    package.mkdir()
    (package / "__init__.py").write_text(code)
    (package / "evil.py").write_text(code)


def _installed_names() -> set[str]:
    return {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} | set(BUILTIN_PLUGINS)


def test_plugins_in_cwd_are_not_loaded_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "marker"
    _plant_fake_plugins(tmp_path, marker)
    monkeypatch.chdir(tmp_path)
    manager = create_plugin_manager()
    names = {name for name, plugin in manager.list_name_plugin() if plugin is not None}
    assert names <= _installed_names()
    assert {"discover", "combine", "compress", "generate", "merge"} <= names
    for name, plugin in manager.list_name_plugin():
        origin = getattr(plugin, "__file__", "") or ""
        assert not origin.startswith(str(tmp_path)), f"{name} loaded from {origin}"
    assert not marker.exists()


def test_plugins_in_cwd_are_not_loaded_by_the_command(tmp_path: Path) -> None:
    command = shutil.which("opguard")
    if command is None:
        pytest.skip("the opguard console script is not on PATH")
    marker = tmp_path / "marker"
    work = tmp_path / "work"
    work.mkdir()
    _plant_fake_plugins(work, marker)
    shutil.copy(SAMPLE, work / "t.json")
    env = {**os.environ, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "out")}
    env.pop("PYTHONPATH", None)
    env.pop("OPGUARD_DISABLE_PLUGINS", None)
    listed = subprocess.run(
        [command, "plugins", "--all", "--json"], cwd=work, env=env, capture_output=True, check=True
    )
    names = {p["name"] for p in json.loads(listed.stdout)}
    assert names <= _installed_names()
    run = subprocess.run(
        [command, "--log-format", "json", "run", "-i", "t.json", "--basic"],
        cwd=work,
        env=env,
        capture_output=True,
    )
    assert run.returncode == 0, run.stderr.decode()
    assert not marker.exists()
    (run_dir,) = (tmp_path / "out").iterdir()
    filtered = (run_dir / "t_filtered_instrumentation.yaml").read_text()
    assert "target:" in filtered  # the planted filter (which empties entries) did not run
    assert sys.modules.get("opguard_evil") is None
