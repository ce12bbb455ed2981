"""The fast config reader's C twin (``opguard_core/formats/_config_reader.c``) against
its Python reference (``config_reader.py_read_fast``), and the strict read (the
write-back checked as it reads) against the reference's whole write-back check.

Both are held on the bundled sample configs, on drawn configs with adversarial
strings (``test_fast_yaml``'s strategy) and on texts broken from those a line or a
token at a time; and whatever the strict read accepts, the fast writer writes back
byte for byte (the guarantee that ruamel reads it the same). Those tests skip where
the C extension was not built (an error under ``OPGUARD_REQUIRE_NATIVE``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from compiled import compiled, needs
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from ruamel.yaml.comments import CommentedMap, CommentedSeq, Format
from test_fast_yaml import configs, sample_config, strings

from opguard_core.cli.app import cli_for
from opguard_core.errors import ExitCode, InputError
from opguard_core.formats import config, config_reader
from opguard_core.formats.config import dump_config, parse_config, split_entry_comments
from opguard_core.formats.config_reader import MAX_INT_CHARS, MAX_LEVEL, py_read_fast
from opguard_core.formats.styles import block_map, flow_seq

native = compiled("opguard_core.formats._config_reader")
needs_c = needs(native)
SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def shape(value: Any) -> Any:
    """Everything about a read config that the writer or a reader of it can see:
    container types and styles, key order, ``_ok``, each scalar's type and value."""
    if isinstance(value, CommentedMap):
        return (
            "map",
            value.fa.flow_style(),
            sorted(map(repr, value._ok)),
            [(shape(k), shape(v)) for k, v in value.items()],
        )
    if isinstance(value, CommentedSeq):
        return ("seq", value.fa.flow_style(), [shape(v) for v in value])
    return (type(value).__name__, repr(value))


def c_read(text: str, strict: bool = False) -> Any:
    assert native is not None
    read = native.read_strict if strict else native.read_fast
    return read(text, CommentedMap, CommentedSeq, Format, MAX_LEVEL, MAX_INT_CHARS)


def reference_load(text: str) -> CommentedMap | None:
    """The reference of ``_load_fast``: read in Python, then the whole config written
    back and compared."""
    found = py_read_fast(text)
    return None if found is None or config._dump_fast(found) != text else found


def strict_load(text: str) -> CommentedMap | None:
    found = c_read(text, strict=True)
    return None if found is None else config._spelled_as_written(found)


def assert_twins(text: str) -> None:
    """The C reader reads ``text`` as the reference does, and the strict read accepts
    it exactly when the reference's write-back check does, as the same config; what
    it accepts the writer writes back to ``text``."""
    expected = py_read_fast(text)
    got = c_read(text)
    assert (got is None) == (expected is None)
    if expected is not None:
        assert shape(got) == shape(expected)
    checked = reference_load(text)
    strict = strict_load(text)
    assert (strict is None) == (checked is None), text
    if strict is not None:
        assert shape(strict) == shape(checked)
        assert config._dump_fast(strict) == text


def broken(text: str, data: st.DataObject) -> str:
    """``text`` with one line or one token changed."""
    lines = text.split("\n")
    at = data.draw(st.integers(0, len(lines) - 1))
    line = lines[at]
    edit = data.draw(st.sampled_from(["char", "insert", "drop", "swap", "token"]))
    where = data.draw(st.integers(0, len(line)))
    piece = data.draw(
        st.sampled_from(
            [" ", "  ", "-", "- ", ":", ": ", ",", ", ", "'", "''", '"', "[", "]", "{", "}",
             "#", "&a ", "*a", "!!str ", "-0", "0", "00", "1.0", "1e5", ".5", "true", "null",
             "~", "\\", "\t", "é", "日本", "x" * 101, "[[1]]", "{a: 1, a: 2}", "'x'", '"x"']
        )
    )  # fmt: skip
    if edit == "char" and line:
        line = line[: min(where, len(line) - 1)] + piece + line[min(where, len(line) - 1) + 1 :]
    elif edit == "insert":
        line = line[:where] + piece + line[where:]
    elif edit == "drop":
        line = line[:where] + line[where + 1 :]
    elif edit == "swap" and at + 1 < len(lines):
        lines[at + 1], line = line, lines[at + 1]
    elif edit == "token" and ": " in line:
        line = line.split(": ", 1)[0] + ": " + piece
    lines[at] = line
    return "\n".join(lines)


# ----------------------------------------------------------------- bundled configs


@needs_c
@pytest.mark.parametrize("label", ["fsdp", "gpt"])
@pytest.mark.parametrize("depth", [0, 1, 3])
def test_sample_configs_read_the_same(label: str, depth: int) -> None:
    text, _ = split_entry_comments(dump_config(sample_config(label, depth)))
    assert c_read(text) is not None
    assert_twins(text)
    assert strict_load(text) is not None


# ----------------------------------------------------------------- drawn configs


@needs_c
@SETTINGS
@given(configs(strings))
def test_drawn_configs_read_the_same(drawn: CommentedMap) -> None:
    text, _ = split_entry_comments(dump_config(drawn))
    assert_twins(text)


@needs_c
@SETTINGS
@given(configs(strings), st.data())
def test_broken_texts_read_the_same(drawn: CommentedMap, data: st.DataObject) -> None:
    text, _ = split_entry_comments(dump_config(drawn))
    for _ in range(3):
        text = broken(text, data)
        assert_twins(text)


# ----------------------------------------------------------------- the strict rules

BASE = "version: 4\nsource: s\nmeta:\n  total: 1\nentries:\n  - target: a:b\n    count: 1\n"


@needs_c
@pytest.mark.parametrize(
    "text",
    [
        BASE.replace("total: 1", "total: -0"),  # the writer writes 0
        BASE.replace("total: 1", "true: 1"),  # a bool key: never written
        BASE.replace("total: 1", "1.5: 1"),  # a float key
        BASE.replace("total: 1", "x" * 100 + ": 1"),  # a key of 100 characters: `? key`
        BASE.replace("total: 1", "1" + "0" * 99 + ": 1"),  # an int key of 100 digits
        BASE.replace("total: 1", "r: [[[1]], 2]"),  # a flow sequence two deep inside one
        BASE.replace("total: 1", "r: {a: 1, a: 2}"),  # a key twice in a flow mapping
        BASE.replace("source: s", "source: 'x'") + "    x: x\n",  # x written two ways
        BASE.replace("source: s", "source: 'x'"),  # quoted where the writer writes plain
        BASE.replace("source: s", "source: 'null'").replace("target: a:b", "target: null"),
        BASE.replace("total: 1", "f: 1.50"),  # ruamel writes 1.5
        BASE.replace("total: 1", "total: "),  # no value after ": ": the writer writes "total:"
    ],
)
def test_what_the_writer_would_not_write_back_falls_back(text: str) -> None:
    assert strict_load(text) is None
    assert reference_load(text) is None
    assert_twins(text)


@needs_c
def test_the_writers_own_spellings_are_accepted() -> None:
    text = (
        "version: 4\nsource: 'null'\nmeta:\n  total: 0\n  f: 1.5\n  r: {a: [1, 2], b: x y}\n"
        "entries:\n  - target: a:b\n    context: ['true', \"'q'\", it's, 'a: b', ok]\n"
        "    count: 1\n    file:\n"
    )
    assert reference_load(text) is not None
    assert strict_load(text) is not None
    assert_twins(text)


# ----------------------------------------------------------------- limits


def nested(levels: int) -> str:
    """A config whose ``meta`` holds block mappings ``levels`` deep below the top."""
    lines = ["version: 4", "source: s", "meta:"]
    for level in range(1, levels):
        lines.append("  " * level + f"k{level}:")
    lines.append("  " * levels + "x: 1")
    return "\n".join(lines) + "\nentries:\n  - target: a:b\n    count: 1\n"


@needs_c
def test_deep_configs_are_left_to_ruamel_and_refused_as_it_refuses_them() -> None:
    shallow = nested(MAX_LEVEL - 2)
    assert c_read(shallow) is not None
    assert_twins(shallow)
    deep = nested(40)
    assert c_read(deep) is None and py_read_fast(deep) is None
    with pytest.raises(InputError, match="nested deeper than 32 levels"):
        parse_config(deep, "deep.yaml")


@needs_c
def test_long_integers_are_left_to_ruamel_and_refused_as_it_refuses_them() -> None:
    text = BASE.replace("total: 1", "total: " + "9" * (MAX_INT_CHARS + 1))
    assert c_read(text) is None and py_read_fast(text) is None
    with pytest.raises(InputError, match="an integer of 101 characters"):
        parse_config(text, "long.yaml")
    fits = BASE.replace("total: 1", "total: " + "9" * MAX_INT_CHARS)
    assert_twins(fits)
    assert parse_config(fits, "fits.yaml")["meta"]["total"] == int("9" * MAX_INT_CHARS)


@needs_c
def test_lone_surrogates_are_read_by_the_reference() -> None:
    text = BASE.replace("a:b", "a\udc80b")
    with pytest.raises(UnicodeEncodeError):
        c_read(text)
    assert config_reader.read_fast(text) is not None  # the reference read it
    with pytest.raises(config_reader.NoStrictReader):
        config_reader.read_strict(text)


@needs_c
def test_without_the_extension_the_reference_and_its_check_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sample = sample_config("gpt")
    sample["meta"]["settings"]["deep"] = block_map([("inner", flow_seq([0.5, "x"]))])
    text, _ = split_entry_comments(dump_config(sample))
    with_c = config._load_fast(text)
    monkeypatch.setattr(config_reader, "_native", None)
    with pytest.raises(config_reader.NoStrictReader):
        config_reader.read_strict(text)
    without = config._load_fast(text)
    assert with_c is not None and without is not None
    assert shape(with_c) == shape(without)


# ----------------------------------------------------------------- the writer's shortcut


@SETTINGS
@example("a:", False)
@example("mod:fn:", True)
@example("aten::add", True)
@example("torch.nn:Linear.forward", False)
@example("yes:no", False)
@given(
    st.from_regex(config._SAFE_PLAIN, fullmatch=True).filter(lambda s: "\n" not in s),
    st.booleans(),
)
def test_names_the_writer_writes_plain_unanalysed_are_what_the_emitter_decides(
    name: str, flow: bool
) -> None:
    """``_SAFE_PLAIN`` (``mod:fn``, ``aten::add``, ``a/b.py``) skips ruamel's
    per-character analysis; the analysis decides the same for every such name."""
    writer = config._FastWriter()
    shortcut = writer.quote(name, flow)
    original = config._SAFE_PLAIN
    try:
        config._SAFE_PLAIN = re.compile(r"(?!)")  # matches nothing: always analysed
        assert config._FastWriter().quote(name, flow) == shortcut
    finally:
        config._SAFE_PLAIN = original


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (nested(40), "nested deeper than 32 levels"),
        (BASE.replace("total: 1", "total: " + "9" * 150), "an integer of 150 characters"),
    ],
)
def test_merge_refuses_what_ruamel_refuses_in_one_line(
    tmp_path: Path, text: str, problem: str
) -> None:
    """A config of the fast writer's layout past ruamel's limits: ``opguard merge``
    refuses it as it refuses any other, one line naming the file, exit 5."""
    bad, good = tmp_path / "bad.yaml", tmp_path / "good.yaml"
    bad.write_text(text)
    good.write_text(BASE)
    argv = ["merge", str(good), str(bad), "-o", str(tmp_path / "out.yaml")]
    result = CliRunner().invoke(cli_for(argv), argv, catch_exceptions=False)
    assert result.exit_code == ExitCode.INPUT_UNREADABLE
    assert "bad.yaml" in result.stderr and problem in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out.yaml").exists()
