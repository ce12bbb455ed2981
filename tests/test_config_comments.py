"""Comments a person writes above an entry belong to it: a hypothesis property over
arbitrary configs and comment text (load, dump, load again; merge with itself)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from opguard_core.formats.config import (
    SUMMARY_RE,
    dump_config,
    entry_comments,
    entry_key,
    parse_config,
)
from opguard_plugins.stages.merge import merge_configs
from tests.strategies import configs, plain

TEXT = (
    st.text(
        st.characters(whitelist_categories=("L", "N", "P", "S", "Zs"), max_codepoint=0xFFFF),
        min_size=1,
        max_size=30,
    )
    .map(lambda t: " ".join(t.split()))
    .filter(bool)
    .map(lambda t: "# " + t)
    .filter(lambda c: SUMMARY_RE.fullmatch(f"  {c}\n") is None)
)


@st.composite
def commented(draw: st.DrawFn) -> tuple[str, list[list[str]], object]:
    """A config's text with comment lines above its entries; the lines per entry."""
    config = draw(configs())
    lines = dump_config(config).splitlines(keepends=True)
    blocks: list[list[str]] = []
    out: list[str] = []
    inside = False  # in the top-level entries (not another list, such as collectives)
    for line in lines:
        if line[0] not in " #":
            inside = line == "entries:\n"
        if inside and line.startswith("  - "):
            block = draw(st.lists(TEXT, max_size=3, unique=True))
            blocks.append(block)
            summary = out.pop() if out and SUMMARY_RE.fullmatch(out[-1]) else None
            at_top = draw(st.booleans())  # above or below the writer's summary line
            out += ([summary] if summary and at_top else []) + [f"  {c}\n" for c in block]
            out += [summary] if summary and not at_top else []
        out.append(line)
    return "".join(out), blocks, config


@settings(max_examples=60, deadline=None)
@given(commented())
def test_comments_above_an_entry_stay_with_it_and_the_data_is_unchanged(case) -> None:
    text, blocks, config = case
    loaded = parse_config(text, "x.yaml")
    assert plain(loaded) == plain(config)
    assert [entry_comments(e) for e in loaded["entries"]] == blocks
    written = dump_config(loaded)
    again = parse_config(written, "x.yaml")
    assert [entry_comments(e) for e in again["entries"]] == blocks
    assert dump_config(again) == written  # a fixed point: summaries regenerated, not piled up
    merged = merge_configs(loaded, again)
    by_key = {entry_key(e): entry_comments(e) for e in merged["entries"]}
    assert by_key == {entry_key(e): b for e, b in zip(loaded["entries"], blocks, strict=True)}
