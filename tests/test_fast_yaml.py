"""The fast config writer (config_format._dump_fast) is byte-identical to ruamel.yaml.

``dump_config`` writes a config of the generated shape by string building and falls
back to ruamel's round-trip dumper for anything else (comments, anchors, tags, odd
scalar types, strings with line breaks or characters that need escapes). These tests
compare the two writers on real configs and on adversarial strings, and check the
fall-backs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ruamel.yaml.comments import CommentedMap, CommentedSeq

from opguard_core.errors import InputError
from opguard_core.formats.config import (
    CONFIG_VERSION,
    _dump_fast,
    _dump_with_ruamel,
    annotate_entries,
    dump_config,
    entry_key,
    parse_config,
)
from opguard_core.formats.config_reader import read_strict
from opguard_core.formats.op_ranks import ranges_seq
from opguard_core.formats.styles import block_map, flow_map, flow_seq
from opguard_core.model import RunOptions
from opguard_plugins.stages.basic_filter import opguard_filter
from opguard_plugins.stages.combine import combine_files
from opguard_plugins.stages.compress import compress_trace
from opguard_plugins.stages.generate import generate_config
from opguard_plugins.stages.merge import merge_configs

SAMPLES = Path(__file__).parent / "data" / "samples"
SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def plain(value: Any) -> Any:
    """Plain Python data of a config (dicts, lists, scalars), for comparisons."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def assert_fast_matches(config: CommentedMap) -> str:
    """The fast writer handles ``config`` and writes exactly ruamel's text."""
    fast = _dump_fast(config)
    assert fast is not None, "the fast writer fell back on a config of the generated shape"
    slow = _dump_with_ruamel(config)
    assert fast == slow
    assert dump_config(config) == annotate_entries(slow, config)
    return dump_config(config)


def sample_config(label: str, depth: int = 1) -> CommentedMap:
    paths = sorted(SAMPLES.glob(f"{label}_callsite_rank*.json"))
    trace = combine_files(paths).result()
    tree = compress_trace(trace, RunOptions())
    return generate_config(tree, f"{label}_callsite", depth)


# ----------------------------------------------------------------- real samples


@pytest.mark.parametrize("label", ["fsdp", "gpt"])
@pytest.mark.parametrize("depth", [0, 1, 3])
def test_sample_configs_are_identical(label: str, depth: int) -> None:
    config = sample_config(label, depth)
    assert config["entries"]
    text = assert_fast_matches(config)
    assert plain(parse_config(text, "fast")) == plain(config)


def test_merged_and_filtered_sample_configs_are_identical() -> None:
    fsdp, gpt = sample_config("fsdp"), sample_config("gpt")
    merged = merge_configs(fsdp, gpt)
    assert_fast_matches(merged)
    again = merge_configs(merged, sample_config("fsdp", 2))
    assert_fast_matches(again)
    assert_fast_matches(opguard_filter(merged, RunOptions()))


def test_a_loaded_config_dumps_back_to_its_text() -> None:
    text = assert_fast_matches(sample_config("fsdp"))
    # loaded configs may hold ruamel scalar types, where the writer falls back
    assert dump_config(parse_config(text, "loaded")) == text


def test_ranges_read_fast_and_three_deep_falls_back() -> None:
    """``op_ranks``' ranges (a flow sequence of ranks and [first, last] sequences) take
    the fast path both ways; a sequence three deep is no layout the writer writes, so
    the strict reader leaves it to ruamel (and the validation refuses it)."""
    config = sample_config("gpt")
    config["meta"]["op_ranks"] = True
    entry = config["entries"][0]
    op = next(iter(entry["ops"]))
    entry["op_ranks"] = flow_map([(op, ranges_seq([0, 1, 2, 3, 7, 9, 10]))])
    text = assert_fast_matches(config)
    assert f"    op_ranks: {{{op}: [[0, 3], 7, 9, 10]}}\n" in text
    bare = _dump_fast(config)  # what the reader reads: the summary lines taken off
    assert bare is not None and read_strict(bare) is not None
    deeper = text.replace("[[0, 3], 7, 9, 10]", "[[[0, 3]], 7]")
    assert read_strict(bare.replace("[[0, 3], 7, 9, 10]", "[[[0, 3]], 7]")) is None
    assert read_strict(deeper) is None
    with pytest.raises(InputError, match=r"\[\[0, 3\]\] is neither a rank nor \[first, last\]"):
        parse_config(deeper, "deeper")  # read by ruamel, then refused by the validation


def test_long_flow_maps_never_wrap() -> None:
    config = sample_config("gpt")
    entry = config["entries"][0]
    entry["ops"] = flow_map((f"aten::op_with_a_long_name_{i:04d}", i) for i in range(400))
    text = assert_fast_matches(config)
    assert max(len(line) for line in text.splitlines()) > 10_000
    assert plain(parse_config(text, "long")["entries"][0]["ops"]) == plain(entry["ops"])


# ----------------------------------------------------------------- adversarial

TRICKY = [
    "", " ", "  ", "a b", "a  b", "a: b", "a:b", "a :b", "a:", "a #b", "a#b", "#a", "#",
    "-", "- a", "-a", "--", "---", "--- a", "...", "?", "? a", "?a", ":", ":a", ": a",
    "*a", "&a", "!a", "!!str", "%a", "@a", "`a", "|", "|a", ">", ">a", "'a", "a'b", "a'",
    "'", "''", '"', 'a"b', '"a"', "\\", "a\\b", "[a]", "a[b]", "{a}", "a,b", "a, b", ",",
    "yes", "no", "Yes", "on", "off", "y", "n", "null", "Null", "NULL", "~", "true", "True",
    "false", "FALSE", "0", "123", "-1", "+1", "1.5", "-1.5e3", "1e3", "0x1F", "0o17", "017",
    "0b101", "1_000", ".inf", "-.inf", ".NaN", "2020-01-01", "2001-12-14t21:59:43.10-05:00",
    "12:30:00", "=", "<<", "a ", " a", "aten::mm", "torch.nn:Linear.forward",
    "<lambda>", "f.<locals>.g", "ü", "é:ß", "日本語", "😀", "a\u00a0b", "\t", "a\tb",
    "a\nb", "\n", "\x00", "\x07", "\x85", "\ufeff", "\u2028", "\x7f", "x" * 99, "y" * 130,
]  # fmt: skip
ALPHABET = list(" :#-?*&!%@`'\",[]{}|>~=<.0123456789abeflnorstuy_+\\éü😀\t\n")

strings = st.one_of(
    st.sampled_from(TRICKY),
    st.text(alphabet=st.sampled_from(ALPHABET), max_size=12),
    st.lists(st.sampled_from(TRICKY), min_size=1, max_size=3).map("".join),
)
#: printable ASCII without line breaks: never needs ruamel
safe_strings = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
counts = st.integers(min_value=0, max_value=2**70)
ints = st.integers(min_value=-(2**70), max_value=2**70)
extra_values = st.one_of(st.none(), st.booleans(), ints)


@st.composite
def configs(draw: st.DrawFn, text: st.SearchStrategy[str]) -> CommentedMap:
    meta_ranks = sorted(draw(st.sets(st.integers(0, 64), max_size=5)))
    entries = []
    for _ in range(draw(st.integers(0, 4))):
        entry = CommentedMap()
        entry["target"] = draw(text)
        entry["kind"] = draw(text)
        entry["file"] = draw(st.one_of(st.none(), text))
        entry["lines"] = flow_seq(draw(st.lists(ints, max_size=3)))
        entry["context"] = flow_seq(draw(st.lists(text, max_size=3)))
        entry["tags"] = flow_seq(draw(st.lists(text, max_size=3)))
        ops = draw(st.dictionaries(text, counts, max_size=4))
        entry["ops"] = block_map(ops.items())
        roles = st.sampled_from(["compute", "comm", "comm2", "side1", "side12"])
        streams = draw(st.dictionaries(roles, counts, max_size=3))
        entry["stream_counts"] = (block_map if draw(st.booleans()) else flow_map)(streams.items())
        entry["count"] = draw(counts)
        if draw(st.booleans()):
            entry["ranks"] = flow_seq(sorted(draw(st.sets(st.integers(0, 64), max_size=4))))
        ranks = list(entry.get("ranks") or meta_ranks)
        if ranks and draw(st.booleans()):  # op_ranks: ranges, sequences inside a sequence
            entry["op_ranks"] = flow_map(
                (op, ranges_seq(sorted(draw(st.sets(st.sampled_from(ranks), min_size=1)))))
                for op in ops
            )
        if draw(st.booleans()):  # a field this version does not know, carried through
            unknown = draw(text.filter(lambda key, known=tuple(entry): key not in known))
            entry[unknown] = draw(st.one_of(extra_values, text))
        if any(entry_key(e) == entry_key(entry) for e in entries):
            continue  # one entry per (target, context): the loader refuses a repeat
        entries.append(entry)
    config = CommentedMap()
    config["version"] = CONFIG_VERSION
    config["source"] = draw(text)
    config["meta"] = block_map(
        [
            ("ranks", flow_seq(meta_ranks)),
            # counts are inclusive: none above the total (the loader refuses it)
            ("total", max((e["count"] for e in entries), default=0) + draw(counts)),
            ("sources", flow_seq(draw(st.lists(text, max_size=2)))),
            # hide patterns must compile (settings are validated at load): the drawn
            # text escaped, which keeps it adversarial for YAML
            (
                "settings",
                block_map(
                    [("hide", flow_seq([re.escape(t) for t in draw(st.lists(text, max_size=2))]))]
                ),
            ),
        ]
    )
    config["entries"] = CommentedSeq(entries) if draw(st.booleans()) else entries
    return config


@SETTINGS
@given(configs(strings))
def test_adversarial_strings_are_identical(config: CommentedMap) -> None:
    fast = _dump_fast(config)
    slow = _dump_with_ruamel(config)
    if fast is not None:
        assert fast == slow
    assert dump_config(config) == annotate_entries(slow, config)


@pytest.mark.slow  # > 4 s: the slow group
@SETTINGS
@given(configs(strings))
def test_adversarial_strings_round_trip(config: CommentedMap) -> None:
    """Every string survives config -> YAML -> load unchanged, on both writers
    (``?x``, ``:x`` and line separators are quoted where ruamel's emitter would not)."""
    text = dump_config(config)
    assert text == annotate_entries(_dump_with_ruamel(config), config)
    assert plain(parse_config(text, "adversarial")) == plain(config)


@SETTINGS
@given(st.text(max_size=30), st.text(max_size=30))
def test_arbitrary_text_round_trips(target: str, op: str) -> None:
    """Arbitrary unicode (not only the tricky alphabet) as a target, a context frame,
    an op name and a key reads back unchanged."""
    entry = CommentedMap()
    entry["target"] = target
    entry["context"] = flow_seq([op, target])
    entry["ops"] = block_map([(op, 1)])
    entry["count"] = 1
    config = CommentedMap([("version", CONFIG_VERSION), ("source", op), ("entries", [entry])])
    if len(op) < 100:
        config["meta"] = block_map([("sources", flow_seq([op])), ("total", 1)])
    assert plain(parse_config(dump_config(config), "arbitrary")) == plain(config)


@SETTINGS
@given(configs(safe_strings))
def test_printable_strings_take_the_fast_path(config: CommentedMap) -> None:
    for entry in config["entries"]:  # keys the emitter writes as `? key` fall back
        for key in [k for k in entry if len(k) >= 100]:
            del entry[key]
        for key in [k for k in entry["ops"] if len(k) >= 100]:
            del entry["ops"][key]
    assert_fast_matches(config)


# ----------------------------------------------------------------- fall-backs


def test_comments_fall_back_to_ruamel() -> None:
    config = sample_config("fsdp")
    config["entries"][0].yaml_add_eol_comment("checked by hand", "target")
    assert _dump_fast(config) is None
    text = dump_config(config)
    assert "# checked by hand" in text
    assert text == annotate_entries(_dump_with_ruamel(config), config)

    start = sample_config("fsdp")
    start.yaml_set_start_comment("generated")
    assert _dump_fast(start) is None
    assert dump_config(start).startswith("# generated\n")


def test_loaded_comments_survive() -> None:
    text = (
        "# a person's note\nversion: 6  # the format\nsource: s\nmeta:\n  total: 10\n"
        "entries:\n  # 4 ops, 40.0% of total\n  - target: a:b  # mine\n    count: 4\n"
        "  # a note before the second entry\n  # 6 ops, 60.0% of total\n  - target: c:d\n"
        "    count: 6\n"
    )
    config = parse_config(text, "commented")
    assert _dump_fast(config) is None
    assert dump_config(config) == text  # summaries rewritten, not doubled; notes kept
    config["entries"][0]["count"] = 5
    assert "  # 5 ops, 50.0% of total\n  - target: a:b  # mine\n" in dump_config(config)


def test_unusual_shapes_fall_back() -> None:
    shared = sample_config("gpt")
    seq = flow_seq(["a", "b"])
    shared["entries"][0]["tags"] = seq
    shared["entries"][1]["tags"] = seq  # the same object twice: ruamel writes an anchor
    assert _dump_fast(shared) is None
    assert "&id001" in dump_config(shared)

    nested = sample_config("gpt")
    nested["entries"][0]["extra"] = [1, 2]  # a block sequence inside an entry
    assert _dump_fast(nested) is None
    assert dump_config(nested) == annotate_entries(_dump_with_ruamel(nested), nested)


@pytest.mark.parametrize("value", [0.5, 0.0, 1e-05, 1e20, 3.0, -2.5])
def test_floats_and_nested_block_maps_take_the_fast_path(value: float) -> None:
    config = sample_config("gpt")
    config["entries"][0]["weight"] = value
    config["meta"]["settings"]["deep"] = block_map([("inner", block_map([("x", value)]))])
    assert_fast_matches(config)
    assert parse_config(dump_config(config), "floats")["entries"][0]["weight"] == value

    escaped = sample_config("gpt")
    escaped["entries"][0]["context"] = flow_seq(["tab\there", "line\nbreak"])
    assert _dump_fast(escaped) is None
    text = dump_config(escaped)
    assert parse_config(text, "escaped")["entries"][0]["context"] == ["tab\there", "line\nbreak"]
