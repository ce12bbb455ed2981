"""Fuzzing (issue 5, part 6): mutated and generated trace documents through the decoder and
the pipeline. Every document either decodes or is refused with InputError; nothing else.

Marked ``slow``; ``.ci/run`` runs it (plain ``pytest``). Run it alone with
``python -m pytest -m slow tests/test_fuzz.py``; ``OPGUARD_FUZZ_SEED=N`` picks another seed.
"""

from __future__ import annotations

import copy
import json
import os
import random
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from opguard_core.combine.accumulator import TraceAccumulator
from opguard_core.errors import InputError
from opguard_core.formats.config import dump_config, parse_config, validate_config
from opguard_core.formats.trace import decode_trace
from opguard_core.formats.tree import check_tree
from opguard_core.model import RunOptions
from opguard_plugins.stages.basic_filter import opguard_filter
from opguard_plugins.stages.compress import compress_trace
from opguard_plugins.stages.generate import generate_config
from opguard_plugins.stages.merge import merge_configs

pytestmark = pytest.mark.slow

SAMPLES = Path(__file__).parent / "data" / "samples"
SEED = int(os.environ.get("OPGUARD_FUZZ_SEED", "20240506"))
DECODER_DOCUMENTS = 12_000
PIPELINE_DOCUMENTS = 400

WEIRD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    2**64 + 1,
    10**30,
    -(2**63),
    1.5,
    -0.0,
    1e308,
    "",
    "x",
    "aten::mm",
    "\u0000",
    "\ud7ff\u202e名前",
    "../../etc/passwd",
    "a" * 1000,
    [],
    [0],
    [-1],
    [10**9],
    [0, 0, 0],
    {},
    {"": None},
    {"stack": []},
    [[[[[]]]]],
]


# ----------------------------------------------------------------------------- seeds


def _small_sample(doc: dict[str, Any], rnd: random.Random, size: int) -> dict[str, Any]:
    """A valid slice of a real sample: some callsites and exactly the frames they use."""
    sites = rnd.sample(doc["callsites"], min(size, len(doc["callsites"])))
    used = sorted({i for s in sites for i in s["stack"]})
    remap = {old: new for new, old in enumerate(used)}
    return {
        **{k: v for k, v in doc.items() if k not in ("frames", "callsites")},
        "frames": [doc["frames"][i] for i in used],
        "callsites": [{**s, "stack": [remap[i] for i in s["stack"]]} for s in sites],
    }


def _seeds(rnd: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(full real samples, small valid slices of them)."""
    full = [json.loads(p.read_bytes()) for p in sorted(SAMPLES.glob("*.json"))]
    small = [_small_sample(doc, rnd, rnd.randint(1, 12)) for doc in full for _ in range(25)]
    return full, small


# ----------------------------------------------------------------------------- mutators


def _random_json(rnd: random.Random, depth: int = 0) -> Any:
    roll = rnd.random()
    if depth > 4 or roll < 0.5:
        return rnd.choice(WEIRD_VALUES)
    if roll < 0.75:
        return [_random_json(rnd, depth + 1) for _ in range(rnd.randint(0, 4))]
    keys = ["format", "version", "meta", "frames", "callsites", "stack", "op", "count", "x"]
    return {rnd.choice(keys): _random_json(rnd, depth + 1) for _ in range(rnd.randint(0, 5))}


def _containers(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths of every dict and list inside ``value`` (the root included)."""
    if isinstance(value, dict):
        yield path
        for key, child in value.items():
            yield from _containers(child, (*path, key))
    elif isinstance(value, list):
        yield path
        for index, child in enumerate(value):
            yield from _containers(child, (*path, index))


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


def mutate_structure(doc: dict[str, Any], rnd: random.Random) -> tuple[str, bytes]:
    """Delete a field, swap a value's type, duplicate or drop an element, or break ids."""
    doc = copy.deepcopy(doc)
    for _ in range(rnd.randint(1, 3)):
        paths = list(_containers(doc))
        target = _at(doc, rnd.choice(paths))
        if not target:
            continue
        key = rnd.choice(list(target)) if isinstance(target, dict) else rnd.randrange(len(target))
        action = rnd.choice(["delete", "replace", "replace", "duplicate", "nest", "id"])
        if action == "delete":
            del target[key]
        elif action == "replace":
            target[key] = rnd.choice([*WEIRD_VALUES, _random_json(rnd)])
        elif action == "duplicate" and isinstance(target, list):
            target.insert(key, copy.deepcopy(target[key]))
        elif action == "nest":
            target[key] = [target[key]] if rnd.random() < 0.5 else {"v": target[key]}
        elif action == "id" and doc.get("callsites") and isinstance(doc["callsites"], list):
            site = rnd.choice(doc["callsites"])
            if isinstance(site, dict) and isinstance(site.get("stack"), list):
                frames = doc.get("frames")
                size = len(frames) if isinstance(frames, list) else 0
                site["stack"].append(rnd.choice([size, 2**40, -1]))
    return "structure", json.dumps(doc, allow_nan=True).encode()


WEIRD_STRINGS = [
    "",
    ".",
    "Tensor.",
    "torch.",
    "a.b.c.",
    "<lambda>",
    "名前.関数",
    "\u202e",
    "x" * 300,
]


def mutate_valid(doc: dict[str, Any], rnd: random.Random) -> tuple[str, bytes]:
    """Changes that keep the document valid but odd: huge counts, odd names and streams,
    empty or repeated stacks, duplicated callsites, odd meta and unknown fields."""
    doc = copy.deepcopy(doc)
    sites, frames = doc["callsites"], doc["frames"]
    for _ in range(rnd.randint(1, 4)):
        site = rnd.choice(sites)
        frame = rnd.choice(frames) if frames else None
        action = rnd.randrange(10)
        if action == 0:
            site["count"] = rnd.choice([1, 2**31, 2**62, 2**64, 10**30])
        elif action == 1:
            site["api"] = rnd.choice([*WEIRD_STRINGS, None])
        elif action == 2:
            site["op"] = rnd.choice(WEIRD_STRINGS)
        elif action == 3:
            site["stream"] = rnd.choice([-1, 7, 2**40, -(2**63)])
        elif action == 4:
            site["stack"] = rnd.choice([[], site["stack"] * 3, list(reversed(site["stack"]))])
        elif action == 5:
            sites.append(copy.deepcopy(site))
        elif action == 6 and frame is not None:
            frame[rnd.choice(["file", "function", "qualname"])] = rnd.choice(WEIRD_STRINGS)
            frame["module"] = rnd.choice([None, *WEIRD_STRINGS])
        elif action == 7 and frame is not None:
            frame["line"] = rnd.choice([0, -1, 2**40])
        elif action == 8:
            doc["meta"] = rnd.choice([{}, {"ranks": [3, 1]}, {"rank": 5, "x": [1, {"y": None}]}])
        else:
            site["extra_field"] = _random_json(rnd)
    return "valid", json.dumps(doc).encode()


def mutate_bytes(data: bytes, rnd: random.Random) -> tuple[str, bytes]:
    """Byte flips, truncation, deletion, insertion, or a splice with garbage."""
    raw = bytearray(data)
    kind = rnd.choice(["flip", "truncate", "delete", "insert", "splice"])
    if kind == "flip":
        for _ in range(rnd.randint(1, 8)):
            raw[rnd.randrange(len(raw))] = rnd.randrange(256)
    elif kind == "truncate":
        del raw[rnd.randrange(len(raw)) :]
    elif kind == "delete":
        start = rnd.randrange(len(raw))
        del raw[start : start + rnd.randint(1, 64)]
    elif kind == "insert":
        chunk = rnd.choice([b"{", b"[", b"]", b"}", b",", b'"', b"NaN", b"\xff", b"-", b"1e999"])
        raw[rnd.randrange(len(raw)) : 0] = chunk * rnd.randint(1, 3)
    else:
        start = rnd.randrange(len(raw))
        raw[start : start + rnd.randint(0, 32)] = rnd.randbytes(rnd.randint(0, 32))
    return kind, bytes(raw)


def fuzz_documents(count: int, seed: int) -> Iterator[tuple[str, bytes]]:
    """``count`` (description, document) pairs, reproducible from ``seed``."""
    rnd = random.Random(seed)
    full, small = _seeds(rnd)
    encoded_full = [json.dumps(d).encode() for d in full]
    for index in range(count):
        roll = rnd.random()
        if roll < 0.05:
            kind, data = mutate_bytes(rnd.choice(encoded_full), rnd)
            yield f"{index}:full-bytes:{kind}", data
        elif roll < 0.35:
            kind, data = mutate_bytes(json.dumps(rnd.choice(small)).encode(), rnd)
            yield f"{index}:bytes:{kind}", data
        elif roll < 0.70:
            kind, data = mutate_structure(rnd.choice(small), rnd)
            yield f"{index}:{kind}", data
        elif roll < 0.85:
            kind, data = mutate_valid(rnd.choice(small), rnd)
            yield f"{index}:{kind}", data
        elif roll < 0.95:
            yield f"{index}:random-json", json.dumps(_random_json(rnd)).encode()
        else:
            yield f"{index}:random-bytes", rnd.randbytes(rnd.randint(0, 64))


# ----------------------------------------------------------------------------- tests


def test_decoder_accepts_or_refuses_cleanly_10k_documents() -> None:
    failures: list[str] = []
    decoded = refused = 0
    for description, data in fuzz_documents(DECODER_DOCUMENTS, SEED):
        try:
            decode_trace(data, "fuzz_rank0.json")
            decoded += 1
        except InputError as exc:
            refused += 1
            message = str(exc)
            if "\n" in message or not message.startswith("fuzz_rank0.json: "):
                failures.append(f"{description}: badly formed message {message!r}")
        except BaseException as exc:  # the point is to catch anything
            failures.append(f"{description}: {type(exc).__name__}: {exc}"[:300])
    assert decoded + refused == DECODER_DOCUMENTS
    assert decoded > 500 and refused > 5000, (decoded, refused)  # both paths exercised
    assert not failures, f"{len(failures)} failures, e.g.\n" + "\n".join(failures[:20])


def _pipeline(data: list[bytes], options: RunOptions) -> None:
    """combine → compress → generate → merge → filter, as the runner chains them."""
    accumulator = TraceAccumulator()
    for index, document in enumerate(data):
        accumulator.add(decode_trace(document, f"fuzz_rank{index}.json"))
    trace = accumulator.result()
    again = decode_trace(trace.to_json(), "fuzz_combined.json")
    assert len(again.callsites) == len(trace.callsites)
    tree = compress_trace(trace, options)
    check_tree(tree, expected_total=trace.total)
    config = generate_config(tree, "fuzz", options.context_depth)
    validate_config(config, "generated")
    text = dump_config(config)
    reloaded = parse_config(text, "fuzz_instrumentation.yaml")
    assert dump_config(reloaded) == text
    assert isinstance(YAML(typ="safe").load(text), dict)
    merged = merge_configs(reloaded, config)
    validate_config(merged, "merged")
    assert merged["meta"]["total"] == 2 * trace.total
    filtered = opguard_filter(parse_config(dump_config(merged), "m.yaml"), options)
    validate_config(filtered, "filtered")


def test_pipeline_in_process_fails_only_with_the_clean_error() -> None:
    rnd = random.Random(SEED + 1)
    failures: list[str] = []
    completed = refused = 0
    stream = fuzz_documents(PIPELINE_DOCUMENTS * 2, SEED + 2)
    _, small = _seeds(rnd)
    for _ in range(PIPELINE_DOCUMENTS):
        # one fuzzed rank file beside one or two valid ones (usually), or two fuzzed ones
        documents = [next(stream)[1] for _ in range(rnd.choice([1, 1, 2]))]
        documents += [json.dumps(rnd.choice(small)).encode() for _ in range(rnd.randint(0, 2))]
        options = RunOptions(
            min_count=rnd.choice([1, 2, 10]),
            min_fraction=rnd.choice([0.0, 0.001, 0.2]),
            chains=rnd.random() < 0.7,
            default_hide=rnd.random() < 0.7,
            context_depth=rnd.choice([0, 1, 2]),
            basic=True,
        )
        try:
            _pipeline(documents, options)
            completed += 1
        except InputError:
            refused += 1
        except BaseException as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            failures.append(f"{type(exc).__name__}: {exc} at {where.filename}:{where.lineno}"[:300])
    assert completed > 50 and refused > 50, (completed, refused)
    assert not failures, f"{len(failures)} failures, e.g.\n" + "\n".join(failures[:20])


def test_cli_runs_on_fuzzed_inputs_fail_only_with_the_clean_error(
    opguard: Callable[..., Any], tmp_path: Path
) -> None:
    """A few whole runs: several fuzzed entries and one good entry per run."""
    stream = fuzz_documents(60, SEED + 3)
    good = SAMPLES / "gpt_callsite_rank0.json"
    for run_index in range(6):
        folder = tmp_path / f"run{run_index}"
        folder.mkdir()
        names = []
        for index in range(10):
            _, data = next(stream)
            name = f"fuzz{index}.json"
            (folder / name).write_bytes(data)
            names.append(name)
        args = [arg for name in names for arg in ("-i", name)]
        run = opguard("run", "--base-dir", folder, *args, "-i", good, "--basic")
        assert run.exit_code in (0, 1), run.stderr
        assert "Traceback" not in run.stderr
        summary = json.loads(run.read("pipeline_summary.json"))
        for stage in summary["stages"]:
            if stage["status"] == "failed":
                # a clean InputError names the file; anything else is "TypeName: ..."
                assert stage["error"].startswith(str(folder)), stage
        assert (run.run_dir / "gpt_callsite_instrumentation.yaml").is_file()
        assert not list(run.run_dir.glob("*.tmp"))
