"""Generate a realistic, large set of per-rank callsite traces (formats.md §1).

Shape of the data (all deterministic for a given ``--seed``):

* a **frame pool** of a few thousand Python code locations (``--frames``): model
  code (``bench_model.layers.attention:Attention.forward`` ...), torch internals
  (``torch.nn.functional:linear``, ``torch.autograd.graph`` ...), the training loop,
  and the plumbing frames a real tracer records (``Module._call_impl``,
  ``Module._wrapped_call_impl``, ``contextlib`` wrappers), each function with a few
  lines;
* a **call graph** shaped like a model's: functions live on call levels, callees
  are picked from the next levels, and module calls go through the
  ``_wrapped_call_impl`` / ``_call_impl`` pair; stacks are root-to-leaf paths of a
  lazily grown tree, so they share long prefixes, 20–60 frames deep
  (``--min-depth`` / ``--max-depth``);
* every leaf issues one to three (api, op, stream) callsites with realistic torch
  api / aten op pairs and counts (steps × layers);
* per rank, ``M`` distinct callsites (``--callsites``): ``1 - specific`` of them are
  shared by every rank, the rest (``--specific``, default 3 %) are rank-specific,
  drawn per rank from a bounded pool of variant paths (data-dependent branches,
  pipeline / tensor-parallel roles: a variant is on about 1/``--variant-spread`` of
  the ranks), plus a few callsites only rank 0 has (logging, checkpointing);
* frame ids are **permuted differently in every file**; counts vary a little per
  rank for some callsites.

Writes ``{label}_callsite_rank{R}.json`` for R in 0…N-1; one callsite per line, as the
tracer writes them. 16 ranks × 40k callsites are about 175 MB (≈ 11 MB per rank).

    python benchmarks/generate_traces.py --ranks 16 --callsites 40000 --out /tmp/og16
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

#: (api, op) pairs a transformer training step issues, weighted by how common they are.
API_OPS: tuple[tuple[str | None, str, int], ...] = (
    ("torch.nn.functional.linear", "aten::addmm", 12),
    ("torch.nn.functional.linear", "aten::linear", 4),
    ("torch.matmul", "aten::mm", 6),
    ("torch.matmul", "aten::bmm", 3),
    ("torch.nn.functional.layer_norm", "aten::native_layer_norm", 4),
    ("torch.nn.functional.gelu", "aten::gelu", 3),
    ("torch.nn.functional.silu", "aten::silu", 2),
    ("torch.nn.functional.dropout", "aten::native_dropout", 3),
    ("torch.nn.functional.scaled_dot_product_attention", "aten::_flash_attention_forward", 2),
    ("torch.nn.functional.embedding", "aten::embedding", 1),
    ("torch.nn.functional.cross_entropy", "aten::nll_loss_forward", 1),
    ("torch.nn.functional.softmax", "aten::_softmax", 2),
    ("Tensor.view", "aten::view", 8),
    ("Tensor.reshape", "aten::reshape", 4),
    ("Tensor.transpose", "aten::transpose", 4),
    ("Tensor.contiguous", "aten::clone", 2),
    ("Tensor.__getitem__", "aten::slice", 3),
    ("Tensor.add", "aten::add", 4),
    ("Tensor.mul", "aten::mul", 4),
    ("Tensor.to", "aten::_to_copy", 2),
    ("Tensor.backward", "aten::mm", 3),
    ("Tensor.backward", "aten::sum", 2),
    ("Tensor.backward", "aten::threshold_backward", 1),
    ("torch.cat", "aten::cat", 2),
    ("torch.split", "aten::split", 2),
    ("torch.empty", "aten::empty", 3),
    ("torch.zeros", "aten::zeros", 2),
    ("torch.distributed.all_reduce", "c10d::allreduce_", 1),
    ("torch.distributed.all_gather_into_tensor", "c10d::_allgather_base_", 1),
    ("torch.distributed.reduce_scatter_tensor", "c10d::_reduce_scatter_base_", 1),
    ("torch._foreach_add_", "aten::_foreach_add_", 1),
    ("torch._foreach_mul_", "aten::_foreach_mul_", 1),
    (None, "aten::copy_", 2),
    (None, "aten::detach", 1),
)

MODEL_PARTS = (
    "attention",
    "mlp",
    "embedding",
    "norm",
    "block",
    "rotary",
    "moe",
    "router",
    "head",
    "loss",
)
TORCH_PARTS = (
    ("torch/nn/functional.py", "torch.nn.functional"),
    ("torch/autograd/__init__.py", "torch.autograd"),
    ("torch/autograd/graph.py", "torch.autograd.graph"),
    ("torch/_tensor.py", "torch._tensor"),
    ("torch/optim/adamw.py", "torch.optim.adamw"),
    ("torch/optim/optimizer.py", "torch.optim.optimizer"),
    ("torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py", "torch.distributed.fsdp"),
    ("torch/distributed/distributed_c10d.py", "torch.distributed.distributed_c10d"),
    ("torch/utils/checkpoint.py", "torch.utils.checkpoint"),
    ("torch/amp/autocast_mode.py", "torch.amp.autocast_mode"),
)
VERBS = (
    "forward",
    "compute",
    "project",
    "apply",
    "step",
    "update",
    "reduce",
    "gather",
    "split",
    "merge",
    "scale",
    "route",
    "mask",
    "pack",
    "unpack",
    "prepare",
)


@dataclass(frozen=True)
class Shape:
    ranks: int
    callsites: int
    frames: int = 3000
    min_depth: int = 20
    max_depth: int = 60
    specific: float = 0.03
    variant_spread: int = 4
    #: the chance that a callsite's count on a rank is off by 1-3 (per-rank noise)
    noise: float = 0.1
    label: str = "bench"
    seed: int = 0


class FramePool:
    """The frame pool, grouped into functions placed on call levels."""

    def __init__(self, rng: random.Random, size: int, levels: int) -> None:
        self.frames: list[dict[str, object]] = []
        #: functions per call level: each a list of frame ids (its lines)
        self.levels: list[list[list[int]]] = [[] for _ in range(levels)]
        self.call_impl = self._function(
            "torch/nn/modules/module.py",
            "torch.nn.modules.module",
            "Module._call_impl",
            "_call_impl",
            [1773],
        )[0]
        self.wrapped = self._function(
            "torch/nn/modules/module.py",
            "torch.nn.modules.module",
            "Module._wrapped_call_impl",
            "_wrapped_call_impl",
            [1762],
        )[0]
        self.inner = self._function(
            "contextlib.py",
            "contextlib",
            "ContextDecorator.__call__.<locals>.inner",
            "inner",
            [81],
        )[0]
        self.roots = [
            self._function("train.py", "train", "<module>", "<module>", [311])[0],
            self._function("train.py", "train", "main", "main", [287])[0],
        ]
        self.steps = self._function(
            "train.py", "train", "train_step", "train_step", [201, 214, 222, 230, 238]
        )
        serial = 0
        while len(self.frames) < size:
            level = serial % levels
            serial += 1
            lines = [rng.randrange(20, 2500) for _ in range(rng.randint(2, 8))]
            if rng.random() < 0.7:
                part = rng.choice(MODEL_PARTS)
                cls = f"{part.title()}{serial}"
                verb = rng.choice(VERBS)
                fn = self._function(
                    f"bench_model/layers/{part}.py",
                    f"bench_model.layers.{part}",
                    f"{cls}.{verb}",
                    verb,
                    sorted(set(lines)),
                )
            else:
                path, module = rng.choice(TORCH_PARTS)
                verb = f"_{rng.choice(VERBS)}_{serial}"
                fn = self._function(path, module, verb, verb, sorted(set(lines)))
            self.levels[level].append(fn)

    def _function(
        self, file: str, module: str, qualname: str, function: str, lines: list[int]
    ) -> list[int]:
        ids = []
        for line in lines:
            ids.append(len(self.frames))
            self.frames.append(
                {
                    "file": file,
                    "line": line,
                    "function": function,
                    "qualname": qualname,
                    "module": module,
                }
            )
        return ids


class CallTree:
    """A lazily grown tree of call paths; each new stack extends a shared prefix."""

    def __init__(self, rng: random.Random, pool: FramePool, shape: Shape) -> None:
        self.rng = rng
        self.pool = pool
        self.shape = shape
        #: node: (frame ids leading to the node, children)
        self.root: tuple[list[int], list[object]] = ([], [])

    def new_stack(self) -> list[int]:
        rng, pool = self.rng, self.pool
        depth = rng.randint(self.shape.min_depth, self.shape.max_depth)
        stack: list[int] = [*pool.roots, rng.choice(pool.steps)]
        node = self.root
        level = 0
        while len(stack) < depth:
            children = node[1]
            # reuse a branch most of the time: stacks share long prefixes
            if children and rng.random() < 0.93 - 0.25 * len(stack) / depth:
                child = children[min(int(rng.expovariate(0.6)), len(children) - 1)]
            else:
                level = min(level + rng.choice((1, 1, 1, 2)), len(pool.levels) - 1)
                fn = rng.choice(pool.levels[level] or pool.levels[0])
                segment = [rng.choice(fn)]
                if rng.random() < 0.45:  # a module call: forward goes through _call_impl
                    segment = [pool.wrapped, pool.call_impl, *segment]
                elif rng.random() < 0.05:
                    segment = [pool.inner, *segment]
                child = (segment, [])
                children.append(child)
            stack.extend(child[0])  # type: ignore[index]
            node = child  # type: ignore[assignment]
        return stack[:depth]


def _callsite(rng: random.Random, stack: list[int], weights: list[int]) -> dict[str, object]:
    api, op, _ = rng.choices(API_OPS, weights=weights)[0]
    site: dict[str, object] = {"stack": stack}
    if api is not None:
        site["api"] = api
    site["op"] = op
    stream = 0 if rng.random() < 0.85 else rng.choice((1, 2, 3))
    site["stream"] = stream
    # the role the tracer writes (formats.md, "Streams and roles"); a collective's raw
    # stream is the caller's, its role comm
    site["role"] = "comm" if is_comm_op(op) else "compute" if stream == 0 else f"side{stream}"
    site["count"] = rng.choice((1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96, 192))
    return site


def build_sites(shape: Shape) -> tuple[FramePool, list[dict[str, object]], list[dict[str, object]]]:
    """The frame pool, the shared callsites, and the pool of rank-specific variants."""
    rng = random.Random(shape.seed)
    pool = FramePool(rng, shape.frames, levels=shape.max_depth)
    tree = CallTree(rng, pool, shape)
    weights = [w for _, _, w in API_OPS]
    n_specific = round(shape.callsites * shape.specific)
    n_shared = shape.callsites - n_specific
    n_variants = n_specific * max(1, shape.variant_spread)
    seen: set[tuple[object, ...]] = set()

    def make(n: int) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        while len(out) < n:
            stack = tree.new_stack()
            for _ in range(rng.choice((1, 1, 2, 3))):
                site = _callsite(rng, stack, weights)
                key = (tuple(stack), site.get("api"), site["op"], site["stream"])
                if key not in seen and len(out) < n:
                    seen.add(key)
                    out.append(site)
        return out

    return pool, make(n_shared), make(n_variants)


def rank_document(
    shape: Shape,
    rank: int,
    pool: FramePool,
    shared: list[dict[str, object]],
    variants: list[dict[str, object]],
) -> bytes:
    rng = random.Random(f"{shape.seed}/rank{rank}")
    n_specific = shape.callsites - len(shared)
    mine = rng.sample(variants, min(n_specific, len(variants)))
    sites = [*shared, *mine]
    if rank == 0:  # rank 0 logs and checkpoints: a few callsites of its own
        extra = random.Random(f"{shape.seed}/rank0-extra")
        for k in range(max(1, shape.callsites // 500)):
            base = extra.choice(shared)
            sites.append({**base, "op": f"aten::_rank0_only_{k}", "count": 1})
    used = sorted({f for site in sites for f in site["stack"]})  # type: ignore[attr-defined]
    order = used[:]
    rng.shuffle(order)  # frame ids differ in every file
    local = {frame: index for index, frame in enumerate(order)}
    rng.shuffle(sites)
    encoder = msgspec.json.Encoder()
    lines = []
    for site in sites:
        doc = dict(site)
        doc["stack"] = [local[f] for f in site["stack"]]  # type: ignore[attr-defined]
        if rng.random() < shape.noise:  # per-rank count noise on some callsites
            doc["count"] = int(site["count"]) + rng.randint(0, 3)  # type: ignore[call-overload]
        lines.append(encoder.encode(doc))
    meta = {
        "label": shape.label,
        "rank": rank,
        "world_size": shape.ranks,
        "ranks": [rank],
        "torch_version": "2.13.0+cu128",
        "device": "cuda",
        "command": f"torchrun --nproc-per-node 8 train.py --ranks {shape.ranks}",
        "tracer": "opguard-bench/1",
        "seed": shape.seed,
    }
    head = msgspec.json.encode(
        {"format": "opguard-callsites", "version": TRACE_VERSION, "meta": meta}
    )
    frames = b",\n".join(encoder.encode(pool.frames[f]) for f in order)
    return b"".join(
        [
            head[:-1],
            b',\n"frames":[\n',
            frames,
            b'\n],\n"callsites":[\n',
            b",\n".join(lines),
            b"\n]}\n",
        ]
    )


def generate(shape: Shape, out: Path, quiet: bool = False) -> list[Path]:
    """Write the rank files of ``shape`` under ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    pool, shared, variants = build_sites(shape)
    paths = []
    total = 0
    for rank in range(shape.ranks):
        path = out / f"{shape.label}_callsite_rank{rank}.json"
        data = rank_document(shape, rank, pool, shared, variants)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        total += len(data)
        paths.append(path)
        if not quiet and sys.stderr.isatty():
            print(f"\r{path.name}: {len(data) / 1e6:.1f} MB", end="", file=sys.stderr)
    if not quiet:
        print(
            f"\n{shape.ranks} ranks × {shape.callsites} callsites: {total / 1e6:.0f} MB "
            f"in {time.perf_counter() - started:.1f} s → {out}",
            file=sys.stderr,
        )
    return paths


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", "-n", type=int, default=16)
    parser.add_argument("--callsites", "-m", type=int, default=40_000)
    parser.add_argument("--frames", type=int, default=3000, help="frame pool size")
    parser.add_argument("--min-depth", type=int, default=20)
    parser.add_argument("--max-depth", type=int, default=60)
    parser.add_argument(
        "--specific",
        type=float,
        default=0.03,
        help="fraction of each rank's callsites that are rank-specific",
    )
    parser.add_argument(
        "--variant-spread",
        type=int,
        default=4,
        help="a rank-specific variant is on about 1/this of the ranks",
    )
    parser.add_argument(
        "--noise",
        type=float,
        default=0.1,
        help="chance that a callsite's count on a rank is off by 1-3 (0.1: 81%% of "
        "callsites differ somewhere at 16 ranks, a worst case for per-rank statistics)",
    )
    parser.add_argument("--label", default="bench")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", "-o", type=Path, required=True)
    parser.add_argument("--quiet", "-q", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    shape = Shape(
        ranks=args.ranks,
        callsites=args.callsites,
        frames=args.frames,
        min_depth=args.min_depth,
        max_depth=args.max_depth,
        specific=args.specific,
        variant_spread=args.variant_spread,
        noise=args.noise,
        label=args.label,
        seed=args.seed,
    )
    generate(shape, args.out, quiet=args.quiet)


if __name__ == "__main__":
    main()
