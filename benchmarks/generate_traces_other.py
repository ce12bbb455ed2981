"""Generate rank files shaped unlike ``generate_traces.py``'s, to check figures on data
the project's own generator did not make (docs/performance.md, issue 31).

Where the team's generator grows a model-like call tree (stacks sharing long
prefixes, a few thousand frames, counts equal on most ranks), this one is built to
stress what that one spares:

* a **frame pool of 10,000** (``--frames``) spread over many modules, no plumbing
  frames to hide, each function with one line;
* **stacks of 30–40 frames** (``--min-depth``/``--max-depth``) drawn as random walks
  over a sparse call graph (each function calls a handful of others anywhere in the
  pool), so prefixes are shared only near the root and distinct stacks are many;
* **a count that differs on every rank for every callsite**, collectives included
  (the per-rank statistics, the histograms and the divergence stage see no uniform
  site);
* **rank-only callsites**: about 400 per rank (``--rank-only``) that no other rank
  has, besides the shared ones;
* about 2 % of the callsites are ``c10d::`` collectives (counts differing per rank:
  every one a divergence finding).

Every rank file has ``M`` callsites (``--callsites``); its frames are listed in the
order it first uses them (no common numbering), callsites in a shuffled order.
Deterministic for a ``--seed``. Writes ``{label}_callsite_rank{R}.json``.

    python benchmarks/generate_traces_other.py --ranks 16 --callsites 40000 --out /tmp/other16
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opguard_core.formats.streams import is_comm_op
from opguard_core.formats.trace import TRACE_VERSION

OPS = ("aten::mm", "aten::addmm", "aten::add", "aten::mul", "aten::view", "aten::cat",
       "aten::copy_", "aten::gelu", "aten::sum", "aten::index", "aten::transpose",
       "aten::native_layer_norm", "aten::_softmax", "aten::empty", "aten::relu")  # fmt: skip
COLLECTIVES = ("c10d::allreduce_", "c10d::allgather_", "c10d::broadcast_",
               "c10d::reduce_scatter_", "c10d::alltoall_base_")  # fmt: skip


@dataclass(frozen=True)
class OtherShape:
    """What to generate (see the module docstring)."""

    ranks: int = 16
    callsites: int = 40_000
    frames: int = 10_000
    min_depth: int = 30
    max_depth: int = 40
    rank_only: int = 400
    fanout: int = 6
    collectives: float = 0.02
    label: str = "other"
    seed: int = 0


def _frames(rng: random.Random, count: int) -> list[dict[str, object]]:
    frames = []
    for index in range(count):
        package = f"pkg{index % 97}"
        module = f"{package}.mod{index % 389}"
        kind = rng.random()
        qualname = f"Cls{index % 53}.m{index}" if kind < 0.5 else f"f{index}"
        frames.append({"file": f"/srv/job/{module.replace('.', '/')}.py",
                       "line": 1 + rng.randrange(2000), "function": qualname.split(".")[-1],
                       "qualname": qualname, "module": module})  # fmt: skip
    return frames


class Walks:
    """Stacks as random walks over a sparse call graph of the frame pool."""

    def __init__(self, shape: OtherShape, rng: random.Random) -> None:
        self.shape = shape
        self.rng = rng
        self.calls = [rng.sample(range(shape.frames), shape.fanout) for _ in range(shape.frames)]
        self.roots = rng.sample(range(shape.frames), 8)

    def stack(self) -> tuple[int, ...]:
        depth = self.rng.randint(self.shape.min_depth, self.shape.max_depth)
        frame = self.rng.choice(self.roots)
        out = [frame]
        while len(out) < depth:
            frame = self.rng.choice(self.calls[frame])
            out.append(frame)
        return tuple(out)


def _site(rng: random.Random, walks: Walks, shape: OtherShape) -> tuple[tuple[int, ...], str, int]:
    """A callsite: its stack, its op and a base count."""
    op = rng.choice(COLLECTIVES) if rng.random() < shape.collectives else rng.choice(OPS)
    return walks.stack(), op, rng.randint(1, 400)


def build(
    shape: OtherShape,
) -> tuple[list[dict[str, object]], list[tuple[tuple[int, ...], str, int]], Walks]:
    rng = random.Random(f"other/{shape.seed}")
    frames = _frames(rng, shape.frames)
    walks = Walks(shape, rng)
    shared_count = max(1, shape.callsites - shape.rank_only)
    seen: set[tuple[tuple[int, ...], str]] = set()
    shared = []
    while len(shared) < shared_count:
        stack, op, count = _site(rng, walks, shape)
        if (stack, op) not in seen:
            seen.add((stack, op))
            shared.append((stack, op, count))
    return frames, shared, walks


def rank_document(
    shape: OtherShape,
    rank: int,
    frames: list[dict[str, object]],
    shared: list[tuple[tuple[int, ...], str, int]],
    walks: Walks,
) -> bytes:
    rng = random.Random(f"other/{shape.seed}/rank{rank}")
    walks.rng = random.Random(f"other/{shape.seed}/walks{rank}")
    # 3 * rank + 0..2: a different count on every rank for every callsite
    sites = [(stack, op, count + 3 * rank + rng.randrange(3)) for stack, op, count in shared]
    for _ in range(min(shape.rank_only, shape.callsites)):
        sites.append(_site(walks.rng, walks, shape))  # this rank's own paths
    rng.shuffle(sites)
    local: dict[int, int] = {}
    lines = []
    encoder = msgspec.json.Encoder()
    for stack, op, count in sites:
        ids = [local.setdefault(frame, len(local)) for frame in stack]
        role = "comm" if is_comm_op(op) else "compute"
        lines.append(
            encoder.encode({"stack": ids, "op": op, "stream": 0, "role": role, "count": count})
        )
    order = sorted(local, key=local.__getitem__)
    meta = {"rank": rank, "world_size": shape.ranks, "tracer": "opguard-bench-other/1",
            "seed": shape.seed}  # fmt: skip
    head = msgspec.json.encode(
        {"format": "opguard-callsites", "version": TRACE_VERSION, "meta": meta}
    )
    return b"".join([
        head[:-1], b',\n"frames":[\n', b",\n".join(encoder.encode(frames[f]) for f in order),
        b'\n],\n"callsites":[\n', b",\n".join(lines), b"\n]}\n",
    ])  # fmt: skip


def generate(shape: OtherShape, out: Path, quiet: bool = False) -> list[Path]:
    """Write the rank files of ``shape`` under ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    frames, shared, walks = build(shape)
    paths, total = [], 0
    for rank in range(shape.ranks):
        path = out / f"{shape.label}_callsite_rank{rank}.json"
        data = rank_document(shape, rank, frames, shared, walks)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        total += len(data)
        paths.append(path)
    if not quiet:
        print(f"{shape.ranks} ranks × {shape.callsites} callsites (other): {total / 1e6:.0f} MB "
              f"in {time.perf_counter() - started:.1f} s → {out}", file=sys.stderr)  # fmt: skip
    return paths


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", "-n", type=int, default=16)
    parser.add_argument("--callsites", "-m", type=int, default=40_000)
    parser.add_argument("--frames", type=int, default=10_000)
    parser.add_argument("--min-depth", type=int, default=30)
    parser.add_argument("--max-depth", type=int, default=40)
    parser.add_argument("--rank-only", type=int, default=400, help="callsites only one rank has")
    parser.add_argument("--label", default="other")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", "-o", type=Path, required=True)
    parser.add_argument("--quiet", "-q", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    shape = OtherShape(ranks=args.ranks, callsites=args.callsites, frames=args.frames,
                       min_depth=args.min_depth, max_depth=args.max_depth,
                       rank_only=args.rank_only, label=args.label, seed=args.seed)  # fmt: skip
    generate(shape, args.out, quiet=args.quiet)


if __name__ == "__main__":
    main()
