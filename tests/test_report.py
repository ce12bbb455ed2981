"""report.html: written at the end of every run, rewritten by ``opguard report``,
self-contained, escaped, and (where Chromium is installed) rendered in a browser."""

from __future__ import annotations

import html.parser
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from opguard_core import hookimpl
from opguard_core.cli.app import create_cli
from opguard_core.formats.config import load_config
from opguard_core.formats.tree import load_tree
from opguard_core.plugin.manager import create_plugin_manager
from tests.builders import sample_inputs, trace_doc, write

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
DATA = re.compile(r'<script type="application/json" id="opguard-data">(.*?)</script>', re.S)


def embedded(report: Path) -> dict[str, Any]:
    match = DATA.search(report.read_text())
    assert match is not None
    return json.loads(match.group(1))


def test_every_run_writes_a_self_contained_report(
    opguard: Callable[..., Any], samples: Path
) -> None:
    run = opguard("run", *sample_inputs(samples, "fsdp", "gpt"), expect=0)
    report = run.run_dir / "report.html"
    text = report.read_text()
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=", text)
    assert "default-src 'none'" in text  # the page may not fetch anything
    data = embedded(report)
    assert data["summary"]["status"] == "ok"
    assert [e["name"] for e in data["entries"]] == ["fsdp_callsite", "gpt_callsite"]
    for entry in data["entries"]:
        config = load_config(run.run_dir / f"{entry['name']}_instrumentation.yaml")
        assert len(entry["config"]) == len(config["entries"])
        tree = load_tree(run.run_dir / f"{entry['name']}_compressed.json")
        assert entry["tree"]["c"] == tree["root"]["count"]
    assert [c["name"] for c in data["comparisons"]] == ["comparison_1_vs_2.log"]
    assert data["comparisons"][0]["text"] == run.read("comparison_1_vs_2.log")
    # the run hands the report the configs it wrote; reading them back gives the same page
    report.unlink()
    opguard("report", run.run_dir, expect=0)
    assert embedded(report)["entries"] == data["entries"]


EVIL = "</script><script>alert(1)</script><b>x</b>"


def evil_run(opguard: Callable[..., Any], tmp_path: Path) -> Path:
    src = write(
        tmp_path / "evil.json",
        trace_doc([([("app", "main"), ("app<b>", EVIL)], None, "aten::<i>mm</i>", 7)]),
    )
    return opguard("run", "-i", str(src), expect=0).run_dir


def test_nothing_in_the_inputs_becomes_markup(opguard: Callable[..., Any], tmp_path: Path) -> None:
    run_dir = evil_run(opguard, tmp_path)
    text = (run_dir / "report.html").read_text()
    assert text.count("</script>") == 2  # the data block and the code block, nothing else
    assert "<b>" not in text and "<i>" not in text
    data = embedded(run_dir / "report.html")
    names = json.dumps(data["entries"][0]["tree"])
    assert "alert(1)" in names  # kept as data, shown as text


def test_divergence_findings_and_report_command(opguard: Callable[..., Any], samples: Path) -> None:
    run = opguard("run", *sample_inputs(samples, "gpt"), expect=0)
    finding = {"kind": "missing_on_ranks", "severity": "warning", "ranks": [1],
               "target": "torch:Tensor.view", "op": "aten::view",
               "message": "only on rank 0"}  # fmt: skip
    (run.run_dir / "gpt_callsite_divergence.json").write_text(json.dumps({"findings": [finding]}))
    (run.run_dir / "report.html").unlink()
    result = opguard("report", run.run_dir, expect=0)
    assert result.result.stdout.strip() == str(run.run_dir / "report.html")
    (entry,) = embedded(run.run_dir / "report.html")["entries"]
    assert entry["findings"] == [
        ["warning", "missing_on_ranks", "torch:Tensor.view", "aten::view", "1", "only on rank 0"]
    ]
    (run.run_dir / "gpt_callsite_divergence.json").write_text("[not json")
    opguard("report", run.run_dir, expect=0)
    assert embedded(run.run_dir / "report.html")["entries"][0]["findings"] == []


def test_report_command_bad_run_dir(opguard: Callable[..., Any], tmp_path: Path) -> None:
    result = opguard("report", tmp_path, expect=5)
    assert result.stderr == f"opguard: error: {tmp_path / 'pipeline_summary.json'}: no such file\n"


@pytest.mark.slow  # over 2 s in the quick group
def test_report_embeds_the_tree_not_the_ranks(opguard: Callable[..., Any], tmp_path: Path) -> None:
    """A 1024-rank entry: the report does not grow with the ranks each node lists."""
    ranks = list(range(1024))
    doc = trace_doc(
        [([("app", "main"), ("app", f"f{i}")], None, "aten::mm", 10 + i) for i in range(60)],
        ranks=ranks,
    )
    for i, site in enumerate(doc["callsites"]):
        site["ranks"] = ranks[i % 2 :: 2]  # every node lists 512 ranks
    del doc["meta"]["rank"]
    run_dir = opguard("run", "-i", str(write(tmp_path / "big.json", doc)), expect=0).run_dir
    report = (run_dir / "report.html").stat().st_size
    tree = (run_dir / "big_compressed.json").stat().st_size
    assert report < 100_000 < tree


def test_hook_run_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, samples: Path) -> None:
    seen: list[tuple[Path, dict[str, Any]]] = []
    written: dict[str, Any] = {}

    class Recorder:
        @hookimpl
        def opguard_run_finished(
            self, run_dir: Path, summary: dict[str, Any], configs: dict[str, Any]
        ) -> None:
            seen.append((run_dir, summary))
            written.update(configs)
            raise RuntimeError("a broken end-of-run plugin")

    monkeypatch.setenv("OPGUARD_TRACE_OUTPUT_BASE", str(tmp_path / "out"))
    pm = create_plugin_manager()
    pm.register(Recorder(), name="recorder")
    argv = ["--log-format", "json", "run", *sample_inputs(samples, "gpt")]
    result = CliRunner().invoke(create_cli(pm), argv)
    assert result.exit_code == 0, result.stderr  # a failing hook does not fail the run
    (run_dir,) = (tmp_path / "out").iterdir()
    assert [r for r, _ in seen] == [run_dir.resolve()]
    assert seen[0][1]["status"] == "ok" and seen[0][1]["exit_code"] == 0
    assert "run_finished failed" in result.stderr and "recorder" in result.stderr
    assert (run_dir / "report.html").exists()
    # every config the run wrote, as the objects dumped: the same data as the files
    assert sorted(written) == sorted(p.name for p in run_dir.glob("*instrumentation.yaml"))
    for name, config in written.items():
        assert json.dumps(config) == json.dumps(load_config(run_dir / name))


# ---------------------------------------------------------------- in a browser


class _Dom(html.parser.HTMLParser):
    """Counts what the page built: rows per table role, flame bars, elements by tag."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[str, int]] = []
        self.bars = 0
        self.tags: dict[str, int] = {}
        self.ready = False
        self._stack: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags[tag] = self.tags.get(tag, 0) + 1
        if tag == "body" and a.get("data-ready") == "1":
            self.ready = True
        if tag == "table":
            self.tables.append((a.get("data-role") or "", 0))
        if tag == "tbody":
            self._stack.append("tbody")
        if tag == "tr" and self._stack and self.tables:
            role, rows = self.tables[-1]
            self.tables[-1] = (role, rows + 1)
        if tag == "div" and a.get("class") == "bar":
            self.bars += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "tbody" and self._stack:
            self._stack.pop()


def open_in_chromium(report: Path, tmp_path: Path) -> tuple[_Dom, list[str]]:
    assert CHROMIUM is not None
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'chromium-profile'}"]  # fmt: skip
    done = subprocess.run(
        [*base, "--enable-logging=stderr", "--v=0", "--dump-dom", report.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    shot = tmp_path / "report.png"
    subprocess.run(
        [*base, "--window-size=1200,900", f"--screenshot={shot}", report.as_uri()],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one
    dom = _Dom()
    dom.feed(done.stdout)
    return dom, console


@pytest.mark.slow  # a headless browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium (Debian package) is not installed")
def test_report_renders_in_headless_chromium(
    opguard: Callable[..., Any], samples: Path, tmp_path: Path
) -> None:
    run = opguard("run", *sample_inputs(samples, "fsdp", "gpt"), expect=0)
    dom, console = open_in_chromium(run.run_dir / "report.html", tmp_path)
    assert console == []  # no errors (our code logs nothing at all)
    assert dom.ready
    configs = [rows for role, rows in dom.tables if role == "config"]
    expected = [
        len(load_config(run.run_dir / f"{name}_instrumentation.yaml")["entries"])
        for name in ("fsdp_callsite", "gpt_callsite")
    ]
    assert configs == expected
    assert dom.bars > 50  # the icicle graphs drew their frames


@pytest.mark.slow  # a headless browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium (Debian package) is not installed")
def test_hostile_names_stay_text_in_the_browser(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    run_dir = evil_run(opguard, tmp_path)
    dom, console = open_in_chromium(run_dir / "report.html", tmp_path)
    assert console == [] and dom.ready
    assert "b" not in dom.tags and "i" not in dom.tags
    assert dom.tags["script"] == 2
