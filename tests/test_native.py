"""The C extensions' one loader (opguard_core/native.py) and its two switches.

``load_native`` answers the compiled module, or None where the Python reference must
run: not built, or ``OPGUARD_PURE_PYTHON=1``. ``OPGUARD_REQUIRE_NATIVE=1`` turns a
missing build into an ImportError naming it. Each extension's own tests hold it to
its reference (tests/test_combine_scan.py, test_compress_runs.py,
test_trace_recorder.py); here: the switches, the stubs, and a whole run both ways.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from compiled import EXTENSIONS, compiled, required

from opguard_core.native import PURE_PYTHON_ENV, REQUIRE_NATIVE_ENV, load_native, pure_python

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def switches(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Neither switch set, whatever the environment running the tests says."""
    monkeypatch.delenv(PURE_PYTHON_ENV, raising=False)
    monkeypatch.delenv(REQUIRE_NATIVE_ENV, raising=False)
    return monkeypatch


def test_a_module_that_was_not_built_answers_none(switches: pytest.MonkeyPatch) -> None:
    assert load_native("opguard_core.combine._not_built") is None
    switches.setenv(REQUIRE_NATIVE_ENV, "0")  # "0" and "" are off
    assert load_native("opguard_core.combine._not_built") is None


def test_required_a_missing_build_is_an_error_naming_it(switches: pytest.MonkeyPatch) -> None:
    switches.setenv(REQUIRE_NATIVE_ENV, "1")
    with pytest.raises(ImportError, match=r"opguard_core\.combine\._not_built .*REQUIRE_NATIVE"):
        load_native("opguard_core.combine._not_built")


@pytest.mark.parametrize("name", sorted(EXTENSIONS))
def test_pure_python_answers_none_even_where_built(switches: pytest.MonkeyPatch, name: str) -> None:
    switches.setenv(PURE_PYTHON_ENV, "1")
    switches.setenv(REQUIRE_NATIVE_ENV, "1")  # the reference is asked for: no error
    assert pure_python()
    assert load_native(name) is None
    switches.setenv(PURE_PYTHON_ENV, "0")
    assert not pure_python()


@pytest.mark.parametrize("name", sorted(EXTENSIONS))
def test_each_extension_is_built_and_in_use_where_required(name: str) -> None:
    """.ci/run sets OPGUARD_REQUIRE_NATIVE where a compiler exists: each extension must
    then have built, and (unless OPGUARD_PURE_PYTHON is set) be the one in use."""
    if not required():
        pytest.skip(f"{REQUIRE_NATIVE_ENV} is not set")
    if name.endswith("_recorder"):
        pytest.importorskip("torch")
    module = compiled(name)
    assert module is not None
    if pure_python():
        return
    owner = importlib.import_module(EXTENSIONS[name])
    in_use = {
        "opguard_core.combine._scan": lambda: owner.StackTable is module.StackTable,
        "opguard_plugins.stages._runs": lambda: owner.Runs is module.Runs,
        "opguard_plugins.record._recorder": lambda: owner._Counter is module.Counter,
        "opguard_core.formats._config_reader": lambda: owner._native is module,
    }[name]
    assert in_use(), f"{name} is built but {EXTENSIONS[name]} does not use it"


@pytest.mark.parametrize("name", sorted(EXTENSIONS))
def test_each_stub_names_what_its_extension_exports(name: str) -> None:
    """The ``.pyi`` beside each extension declares exactly its public names (.ci/run's
    ``mypy.stubtest`` also checks their signatures)."""
    module = compiled(name)
    if module is None:
        pytest.skip(f"{name} was not built")
    stub = REPO / (name.replace(".", "/") + ".pyi")
    declared = {
        node.name
        for node in ast.parse(stub.read_text()).body
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
    }
    exported = {key for key in vars(module) if not key.startswith("_")}
    assert declared == exported


def _references_in_use(env: dict[str, str]) -> dict[str, bool]:
    """Per extension, whether a fresh interpreter with ``env`` runs its reference (the
    recorder's only where torch is installed)."""
    script = (
        "import importlib.util\n"
        "from opguard_core.combine import stack_table\n"
        "from opguard_plugins.stages import sorted_runs\n"
        "from opguard_core.formats import config_reader\n"
        "print('opguard_core.combine._scan', stack_table.StackTable is stack_table.PyStackTable"
        " and stack_table.scan_callsites is None and stack_table.fold_rank is None)\n"
        "print('opguard_plugins.stages._runs', sorted_runs.Runs is sorted_runs.PyRuns"
        " and sorted_runs.visible_frames is sorted_runs.py_visible_frames)\n"
        "print('opguard_core.formats._config_reader', config_reader._native is None)\n"
        "if importlib.util.find_spec('torch') is not None:\n"
        "    from opguard_plugins.record.tracer import CallsiteRecorder\n"
        "    print('opguard_plugins.record._recorder', CallsiteRecorder().counter is None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return {name: answer == "True" for name, answer in map(str.split, out.stdout.splitlines())}


def test_pure_python_picks_every_reference() -> None:
    answers = _references_in_use({**os.environ, PURE_PYTHON_ENV: "1"})
    assert set(answers) >= {
        "opguard_core.combine._scan",
        "opguard_plugins.stages._runs",
        "opguard_core.formats._config_reader",
    }
    assert all(answers.values()), answers


def test_without_the_switch_every_built_extension_is_in_use() -> None:
    if pure_python():
        pytest.skip(f"{PURE_PYTHON_ENV} is set for these tests")
    from opguard_core.combine import stack_table
    from opguard_plugins.stages import sorted_runs

    scan, runs = compiled("opguard_core.combine._scan"), compiled("opguard_plugins.stages._runs")
    assert (stack_table.StackTable is stack_table.PyStackTable) == (scan is None)
    assert (stack_table.scan_callsites is None) == (scan is None)
    assert (sorted_runs.Runs is sorted_runs.PyRuns) == (runs is None)
    from opguard_core.formats import config_reader

    reader = compiled("opguard_core.formats._config_reader")
    assert config_reader._native is reader
    if importlib.util.find_spec("torch") is not None:
        from opguard_plugins.record import tracer

        recorder = compiled("opguard_plugins.record._recorder")
        assert (tracer.CallsiteRecorder().counter is None) == (recorder is None)


def test_pure_python_writes_the_same_run(tmp_path: Path) -> None:
    """``OPGUARD_PURE_PYTHON=1`` (msgspec's decode, the Python stack table, fold and
    runs) and the default write the same artifacts for the bundled traces."""
    outputs = []
    for pure in ("1", "0"):
        base = tmp_path / pure
        env = {**os.environ, "OPGUARD_TRACE_OUTPUT_BASE": str(base), PURE_PYTHON_ENV: pure}
        traces = sorted(map(str, (REPO / "examples" / "traces").glob("*_rank*.json")))
        command = [sys.executable, "-m", "opguard_core.cli.app", "run", "--input", *traces]
        subprocess.run([*command, "--basic", "--jobs", "1"], env=env, check=True)
        [run] = base.iterdir()
        outputs.append(
            {
                path.name: path.read_bytes()
                for path in sorted(run.iterdir())
                if path.suffix in (".json", ".yaml", ".log") and path.stem != "pipeline_summary"
            }
        )
    assert outputs[0] == outputs[1] and len(outputs[0]) >= 8
