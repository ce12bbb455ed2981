"""One view (issue 29, points 1 and 2): ``opguard guard`` at run time and ``opguard
check`` on a trace of the same program attribute its ops to the same (target,
context) keys, and report the same violations for the same edit.

The programs are a conv net written as one script (``tests/data/one_view/net.py``:
Block, Net and main defined in ``__main__``, run as ``python net.py``) and the bundled
single-process example. Each is traced once unchanged to make a config; every edited
copy is then traced and checked, and run under the guard. Subprocesses: slow.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.builders import run_opguard as run

pytestmark = [pytest.mark.slow, pytest.mark.torch]

REPO = Path(__file__).resolve().parent.parent
NET = REPO / "tests" / "data" / "one_view" / "net.py"
CHECKPOINTED = REPO / "tests" / "data" / "one_view" / "checkpointed.py"
EXAMPLES = REPO / "examples"

Key = tuple[str, str, tuple[str, ...], str | None, str | None, str | None]


def _edit(old: str, new: str) -> Callable[[str], str]:
    def edit(source: str) -> str:
        assert old in source, old
        return source.replace(old, new)

    return edit


#: edits of net.py: each adds, moves or removes work somewhere check and guard must
#: both name the same way
NET_EDITS: dict[str, Callable[[str], str]] = {
    # the case: an extra gating op inside a method of a class in __main__
    "gate_in_block": _edit(
        "        y = torch.relu(self.norm(self.conv(x)))\n",
        "        y = torch.relu(self.norm(self.conv(x)))\n        y = y * torch.sigmoid(y)\n",
    ),
    # a new function of the script between Net.forward and its work
    "new_helper": _edit(
        "        return self.head(x.mean(dim=(2, 3)))\n",
        "        return self.head(pool(x))\n\n\ndef pool(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x.amax(dim=(2, 3))\n",
    ),
    # an op issued by the training loop itself (main, in __main__)
    "op_in_main": _edit(
        "        loss = loss_fn(model(x), y)\n",
        "        loss = loss_fn(model(x), y) + 0.0 * x.abs().sum()\n",
    ),
    # a removed block: its entries never run
    "one_block": _edit(
        "nn.Sequential(Block(8), Block(8))",
        "nn.Sequential(Block(8))",
    ),
    # the model and its inputs in float64: the same ops, another dtype (formats.md, "Dtypes")
    "float64": _edit(
        "    torch.manual_seed(0)\n",
        "    torch.manual_seed(0)\n    torch.set_default_dtype(torch.float64)\n",
    ),
}


def _keys(violations: list[dict[str, Any]], kinds: set[str] | None = None) -> set[Key]:
    return {
        (v["kind"], v["target"], tuple(v["context"]), v.get("op"), v.get("stream"), v.get("dtype"))
        for v in violations
        if kinds is None or v["kind"] in kinds
    }


def _config(tmp_path: Path, command: list[str]) -> Path:
    proc = run("trace", "--label", "good", "--output-dir", tmp_path / "good", "--", *command)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run(
        "run", "-i", tmp_path / "good" / "good_callsite_rank0.json",
        "--output-base", tmp_path / "run",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    [config] = (tmp_path / "run").glob("*/good_callsite_instrumentation.yaml")
    return config


def _both(tmp_path: Path, config: Path, name: str, command: list[str]) -> tuple[Any, Any]:
    """check's violations on a trace of ``command``, and guard's on a run of it."""
    traces = tmp_path / f"t_{name}"
    proc = run("trace", "--label", name, "--output-dir", traces, "--", *command)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run("check", "--config", config, "--format", "json",
               "-i", traces / f"{name}_callsite_rank0.json")  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    checked = json.loads(proc.stdout)["violations"]
    reports = tmp_path / f"g_{name}"
    proc = run("guard", "--config", config, "--report-dir", reports, "--", *command)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    guarded = json.loads((reports / "guard_report_rank0.json").read_text())
    assert proc.returncode == (1 if guarded["errors"] else 0)
    return checked, guarded["violations"]


def test_guard_and_check_agree_on_a_script_and_its_edits(tmp_path: Path) -> None:
    config = _config(tmp_path, ["python", str(NET), "--steps", "3"])
    checked, guarded = _both(tmp_path, config, "same", ["python", str(NET), "--steps", "3"])
    assert checked == [] and guarded == []  # unchanged: nothing at all, from either
    found: dict[str, set[Key]] = {}
    for name, edit in NET_EDITS.items():
        script = tmp_path / name / "net.py"
        script.parent.mkdir()
        script.write_text(edit(NET.read_text()))
        checked, guarded = _both(tmp_path, config, name, ["python", str(script), "--steps", "3"])
        # the same violations, every kind, the same keys
        assert _keys(checked), name
        assert _keys(guarded) == _keys(checked), (name, _keys(guarded) ^ _keys(checked))
        found[name] = _keys(guarded)
    # the edit the issue named is found in the method of the script's class
    gate = (
        "unexpected_op", "net:Block.forward", ("net:Net.forward",), "aten::sigmoid", None, None
    )  # fmt: skip
    assert gate in found["gate_in_block"]
    assert any(k[0] == "unknown_target" and k[1] == "net:pool" for k in found["new_helper"])
    assert any(k[0] == "missing" for k in found["one_block"]) or any(
        k[0] == "count_drift" for k in found["one_block"]
    )
    # float64: an error in each of the script's functions, naming the dtype
    doubled = {(k[1], k[5]) for k in found["float64"] if k[0] == "unexpected_dtype"}
    assert {("net:Block.forward", "float64"), ("net:Net.forward", "float64")} <= doubled


def test_guard_and_check_agree_on_the_bundled_example(tmp_path: Path) -> None:
    folder = tmp_path / "examples"
    shutil.copytree(EXAMPLES, folder, ignore=shutil.ignore_patterns("traces", "opguard-*"))
    command = ["python", str(folder / "train_single.py"), "--steps", "2"]
    config = _config(tmp_path, command)
    model = folder / "tiny_gpt.py"
    source = model.read_text()
    model.write_text(
        source.replace(
            "        return self.proj(F.gelu(self.fc(x)))",
            "        x = F.gelu(self.fc(x))\n        return self.proj(x * torch.sigmoid(x))",
        )
    )
    checked, guarded = _both(tmp_path, config, "gated", command)
    errors = {"unexpected_op", "unexpected_stream"}
    assert _keys(checked, errors) and _keys(guarded, errors) == _keys(checked, errors)
    assert _keys(guarded) == _keys(checked), _keys(guarded) ^ _keys(checked)


@pytest.mark.parametrize(
    "helper", [False, True, "pre_ln", "attention"], ids=["plain", "helper", "pre_ln", "attention"]
)
def test_guard_and_check_agree_on_a_checkpointed_block(tmp_path: Path, helper: Any) -> None:
    """torch.utils.checkpoint's recomputation stops inside the block's last function
    that saves a tensor: there ``F.batch_norm`` runs under ``Tensor.backward``'s api
    (its entry a function's, no longer the api's) and the helper's only work is the
    pack hook (a chain check's tree folds). Before: the unchanged script under the
    guard had an ``unknown_target`` for ``F.batch_norm`` and, with the helper, an
    ``unexpected_op`` error (``aten::detach`` in ``scaled_gelu``); check had none.
    A pre-LN block (``x + fc(ln(x))``): check's tree folds ``LayerNorm.forward`` into
    ``F.layer_norm`` in the recomputation, where the pack hook runs below it (a frame),
    and keeps it in the forward pass, where ``F.layer_norm`` is the api (a leaf): the
    guard read the recomputation by the forward pass's entries, 3 errors (with
    ``--on-violation raise`` the unchanged job died in its first backward).
    ``nn.MultiheadAttention`` (``x + attn(ln(x))``): ``F.multi_head_attention_forward``
    is the api of its own ops in the forward pass, so check's tree gives them to the
    api's node and folds its frame into ``_in_projection_packed``; in the
    recomputation it is a frame with ops of its own, and its api node and that frame
    share one entry (the frame's kind). The guard: 1 ``missing`` error and 3 warnings
    on the unchanged program."""
    flags = {False: [], True: ["--helper"], "pre_ln": ["--pre-ln"], "attention": ["--attention"]}[
        helper
    ]
    command = ["python", str(CHECKPOINTED), "--steps", "3", *flags]
    config = _config(tmp_path, command)
    checked, guarded = _both(tmp_path, config, "same", command)
    assert checked == [] and guarded == [], _keys(guarded) ^ _keys(checked)
    edits = {
        "pre_ln": "return x + self.fc(self.ln(x))",
        "attention": "return x + self.attn(h, h, h, need_weights=False)[0]",
    }
    if helper in edits:  # an edit inside the block: found by both, the same way
        line = edits[helper]
        gated = line.replace("return x + ", "return x + torch.sigmoid(") + ")"
        script = tmp_path / "gated" / "checkpointed.py"
        script.parent.mkdir()
        script.write_text(_edit(line, gated)(CHECKPOINTED.read_text()))
        command = ["python", str(script), "--steps", "3", *flags]
        checked, guarded = _both(tmp_path, config, "gated", command)
        assert _keys(guarded) == _keys(checked), _keys(guarded) ^ _keys(checked)
        assert any(k[:2] == ("unexpected_op", "checkpointed:Block.forward") for k in _keys(checked))
    if helper is not True:
        return
    script = tmp_path / "tanh" / "checkpointed.py"
    script.parent.mkdir()
    script.write_text(
        _edit("return F.gelu(x) * 0.5", "return torch.tanh(F.gelu(x)) * 0.5")(
            CHECKPOINTED.read_text()
        )
    )
    command = ["python", str(script), "--steps", "3", *flags]
    checked, guarded = _both(tmp_path, config, "tanh", command)
    assert _keys(guarded) == _keys(checked), _keys(guarded) ^ _keys(checked)
    where = ("checkpointed:scaled_gelu", ("checkpointed:Block.forward",), "aten::tanh")
    assert ("unexpected_op", *where) in {k[:4] for k in _keys(guarded)}


RANK0_METRICS = REPO / "tests" / "data" / "one_view" / "rank0_metrics.py"


def _per_rank_keys(violations: list[dict[str, Any]]) -> set[tuple[Any, ...]]:
    return {
        (v["kind"], v["severity"], v["target"], tuple(v["context"]), v.get("op"), rank)
        for v in violations
        for rank in v.get("ranks") or [v["rank"]]
    }


#: ``rank0_metrics.py`` on two ranks under torchrun
RANK0_COMMAND = ["torchrun", "--nproc-per-node", "2", str(RANK0_METRICS)]


def _job_config(tmp_path: Path, command: list[str], *options: str) -> Path:
    """The config of a traced run of the torchrun ``command`` (``opguard run`` with
    ``options``)."""
    proc = run("trace", "--label", "good", "--output-dir", tmp_path / "good", "--", *command)
    assert proc.returncode == 0, proc.stderr[-3000:]
    good = str(tmp_path / "good" / "good_callsite_rank*.json")
    proc = run("run", "-i", good, "--output-base", tmp_path / "run", *options)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [config] = (tmp_path / "run").glob("*/good_callsite_instrumentation.yaml")
    return config


def _job_both(
    tmp_path: Path, config: Path, name: str, command: list[str]
) -> tuple[set[tuple[Any, ...]], list[dict[str, Any]], subprocess.CompletedProcess[str]]:
    """The two-rank torchrun ``command`` traced and checked against ``config``, then
    run under the guard: check's violations by rank, the guard's reports' violations,
    and the guard's process."""
    traces = tmp_path / f"t_{name}"
    proc = run("trace", "--label", "x", "--output-dir", traces, "--", *command)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run("check", "--config", config, "--format", "json",
               "-i", traces / "x_callsite_rank*.json")  # fmt: skip
    checked = _per_rank_keys(json.loads(proc.stdout)["violations"])
    reports = tmp_path / f"g_{name}"
    proc = run("guard", "--config", config, "--report-dir", reports, "--", *command)
    guarded = [json.loads(p.read_text()) for p in sorted(reports.glob("guard_report_rank*"))]
    assert [g["rank"] for g in guarded] == [0, 1]
    return checked, [v for g in guarded for v in g["violations"]], proc


def test_guard_and_check_judge_a_rank_that_does_more_by_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 does more inside ``metrics`` than rank 1 (``if rank == 0``). A config
    held only the job's counts, so each rank drifted from the average and rank 1
    "never ran" rank 0's ops: the config's own program gave 4 ``missing_op`` errors
    from check and guard, and 4 ``count_drift`` warnings from guard. The config now
    records which ranks ran each op (``op_ranks``) and both judge the rest by the job
    (guard from every rank's counts, at the end): an unchanged rerun is clean; the
    metric removed from rank 0 is rank 0's ``missing_op`` alone; a rank that stops
    reading the loss while the other goes on is caught on that rank (the job as a
    whole still ran the op); both commands alike, and the console shows what the
    reports hold."""
    config = _job_config(tmp_path, RANK0_COMMAND)
    metrics = ("rank0_metrics:metrics", ("rank0_metrics:main",))
    for name, extra, skip in (("same", "1", "-1"), ("no_extra", "0", "-1"), ("skip", "1", "1")):
        monkeypatch.setenv("EXTRA", extra)
        monkeypatch.setenv("SKIP_READ", skip)
        checked, violations, proc = _job_both(tmp_path, config, name, RANK0_COMMAND)
        assert _per_rank_keys(violations) == checked, name
        logged = [line for line in proc.stderr.splitlines() if '"opguard guard: violation"' in line]
        assert len(logged) == len(violations), proc.stderr[-3000:]
        errors = {(key[0], key[-2], key[-1]) for key in checked if key[1] == "error"}
        if name == "same":
            assert checked == set() and proc.returncode == 0, proc.stderr[-3000:]
            continue
        assert proc.returncode == 1
        if name == "no_extra":
            assert ("missing_op", "error", *metrics, "aten::exp", 0) in checked
            assert {rank for _, _, rank in errors} == {0}, checked
        else:
            read = ("missing_op", "error", *metrics, "aten::_local_scalar_dense", 1)
            assert read in checked and {rank for _, _, rank in errors} == {1}, checked


def test_guard_prunes_a_function_small_on_one_rank_by_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config made with ``--min-fraction 0.1`` from 3 steps, run for 10: rank 0's
    ``metrics`` (its logging) is large there and small on rank 1, where alone it is
    below the pruning floor. ``opguard check`` prunes the job's tree (the ranks' ops
    added up) and keeps it; the guard pruned each rank's own and gave rank 1 a
    ``missing`` warning ("ran too little … to be an entry of its own") that check did
    not (2026-12-07). The guard now adds up what each rank ran too little of and keeps
    the warning only where the job as a whole ran it too little: an unchanged rerun is
    clean in both, and with rank 0's extra work removed (small on every rank) both
    warn on both ranks."""
    config = _job_config(tmp_path, RANK0_COMMAND, "--min-fraction", "0.1")
    monkeypatch.setenv("STEPS", "10")
    metrics = ("missing", "warning", "rank0_metrics:metrics", ("rank0_metrics:main",), None)
    for name, extra in (("same", "1"), ("no_extra", "0")):
        monkeypatch.setenv("EXTRA", extra)
        checked, violations, proc = _job_both(tmp_path, config, name, RANK0_COMMAND)
        assert _per_rank_keys(violations) == checked, name
        if name == "same":
            assert checked == set() and proc.returncode == 0, proc.stderr[-3000:]
        else:
            assert {(*metrics, 0), (*metrics, 1)} <= checked, checked


OBJECT_METRICS = REPO / "tests" / "data" / "one_view" / "object_metrics.py"


def test_the_bytes_of_an_object_collective_are_not_held_to_their_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``all_gather_object`` and ``broadcast_object_list`` move pickled objects as a
    ``uint8`` tensor as long as their bytes: data, which changes from step to step,
    and the same on every rank. An unchanged program whose metrics dict grows a
    longer note in step 3 than in the config's 3 steps was a ``collective_size`` error
    on both ranks from check and from the guard (and ``--on-violation raise`` killed
    it). That payload is now recorded and compared without its size (its op, dtype
    and group still are): clean in both; an extra object collective is still caught
    on each rank, the same in both."""
    command = ["torchrun", "--nproc-per-node", "2", str(OBJECT_METRICS)]
    config = _job_config(tmp_path, command)
    monkeypatch.setenv("STEPS", "6")
    checked, violations, proc = _job_both(tmp_path, config, "same", command)
    assert checked == set() and _per_rank_keys(violations) == set(), proc.stderr[-3000:]
    assert proc.returncode == 0
    monkeypatch.setenv("EXTRA", "1")
    checked, violations, proc = _job_both(tmp_path, config, "extra", command)
    assert _per_rank_keys(violations) == checked
    extra = {(k[0], k[-1]) for k in checked if k[1] == "error" and k[0].startswith("collective")}
    assert {("collective_extra", 0), ("collective_extra", 1)} <= extra, checked


@pytest.mark.parametrize(
    "selection",
    [
        ["--focus", r"net:Block\..*"],
        ["--ignore", r"torch[.:].*"],
        ["--ignore", r"torch\.optim\..*"],
    ],
    ids=["focus", "ignore", "ignore_optimizer"],
)
def test_a_narrowed_config_holds_check_and_guard_to_the_entries_it_kept(
    tmp_path: Path, selection: list[str]
) -> None:
    r"""A config narrowed with ``opguard filter --focus/--ignore`` (recorded in
    ``meta.settings.filter_focus`` / ``filter_ignore``): what the filter cut out is no
    ``unknown_target`` or ``unknown_context`` to either command, so an unchanged rerun
    is clean for both; an edit inside what it kept is found by both, the same way.
    Ignoring the optimizer (``torch\.optim\..*``): its ``Tensor.add_`` calls ran under
    the program's nearest target in the guard's view, ``unknown_target`` warnings and
    a ``count_drift`` where check had none; now a path through a cut-out frame counts
    for the targets above it only, as check's observed entries do."""
    command = ["python", str(NET), "--steps", "3"]
    narrowed = tmp_path / "narrowed.yaml"
    proc = run("filter", _config(tmp_path, command), *selection, "-o", narrowed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checked, guarded = _both(tmp_path, narrowed, "same", command)
    assert checked == [] and guarded == []
    script = tmp_path / "gated" / "net.py"
    script.parent.mkdir()
    script.write_text(NET_EDITS["gate_in_block"](NET.read_text()))
    checked, guarded = _both(tmp_path, narrowed, "gated", ["python", str(script), "--steps", "3"])
    assert _keys(guarded) == _keys(checked), _keys(guarded) ^ _keys(checked)
    assert any(k[:2] == ("unexpected_op", "net:Block.forward") for k in _keys(checked))
    # nothing the selection drops is reported
    for kind, target, context, *_ in _keys(checked):
        path = [*context, target]
        if selection[0] == "--focus":
            assert any(name.startswith("net:Block.") for name in path), (kind, path)
        else:
            ignored = re.compile(selection[1])
            assert not any(ignored.fullmatch(name) for name in path), (kind, path)
