"""Compression benchmark: throughput and bytes of every compressor beside a plain torch reference,
and a training comparison of dense vs top-k 1 % + error feedback on digits.

Usage (through the project venv)::

    scripts/with-venv.sh python -m edgestream bench compression              # both parts
    scripts/with-venv.sh python -m edgestream bench compression --skip-train # throughput only
    scripts/with-venv.sh python -m edgestream bench compression --only-train # training only (merges JSON)

Writes ``benchmarks/results/compression.json`` (machine, versions, config, every
repeat's raw figures, medians) and ``compression.md`` (the tables). One torch
thread. Never asserts: a missed target is reported, not raised.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

from edgestream.compression import registry
from edgestream.compression.base import Compressor
from edgestream.compression.memory import ErrorFeedback, NoMemory
from edgestream.compression.pipeline import GradientCodec, decode_tensors, encode_tensors

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = ROOT / "benchmarks" / "results"
MB = 1e6  # throughput unit: 10^6 bytes of dense fp32 gradient per second

Grads = dict[str, torch.Tensor]


# ---- the gradient under test ------------------------------------------------------


def digits_split(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standardised digits, stratified 80/20 split (held-out 20 % never trained on)."""
    data = load_digits()
    x = data.data.astype(np.float32)
    y = data.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    train_idx, test_idx = [], []
    for label in range(10):
        members = rng.permutation(np.flatnonzero(y == label))
        cut = int(round(0.2 * members.size))
        test_idx.extend(members[:cut])
        train_idx.extend(members[cut:])
    train_idx, test_idx = np.array(sorted(train_idx)), np.array(sorted(test_idx))
    mean, std = x[train_idx].mean(0), x[train_idx].std(0) + 1e-3
    x = (x - mean) / std
    return (
        torch.from_numpy(x[train_idx]),
        torch.from_numpy(y[train_idx]),
        torch.from_numpy(x[test_idx]),
        torch.from_numpy(y[test_idx]),
    )


def mlp(widths: list[int], seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


BENCH_WIDTHS = [64, 1024, 768, 192, 10]  # 1,003,338 parameters in 8 tensors


def real_gradient(seed: int = 0, warmup_steps: int = 30) -> Grads:
    """Gradient of a ~1M-parameter MLP on one digits batch, after a few SGD steps
    so the value distribution is that of a model in training, not at init."""
    x, y, _, _ = digits_split(seed)
    model = mlp(BENCH_WIDTHS, seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(warmup_steps + 1):
        batch = torch.randint(0, x.shape[0], (64,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        if _ < warmup_steps:
            opt.step()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


# ---- straightforward torch references ------------------------------------------------
# Each is the obvious implementation of the same method with plain torch ops and
# raw tensor bytes: no framing, no validation, torch.topk / randperm where a
# textbook version uses them. Same seeds or parameters as the candidate.


def _raw(*tensors: torch.Tensor) -> list[bytes]:
    return [t.contiguous().numpy().tobytes() for t in tensors]


def _take(data: bytes, offset: int, dtype: torch.dtype, count: int) -> tuple[torch.Tensor, int]:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    np_dtype = {
        torch.float32: np.float32,
        torch.float16: np.float16,
        torch.int32: np.int32,
        torch.int8: np.int8,
        torch.uint8: np.uint8,
    }[dtype]
    arr = np.frombuffer(data, dtype=np_dtype, count=count, offset=offset).copy()
    return torch.from_numpy(arr), offset + count * itemsize


class Reference:
    """Encode a dict of gradients to bytes and back; shapes are known on both sides."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = shapes

    def encode(self, grads: Grads) -> bytes:
        return b"".join(chunk for name, g in grads.items() for chunk in self.encode_layer(name, g))

    def decode(self, data: bytes) -> Grads:
        out, offset = {}, 0
        for name, shape in self.shapes.items():
            flat, offset = self.decode_layer(name, data, offset, math.prod(shape))
            out[name] = flat.reshape(shape)
        return out

    def encode_layer(self, name: str, g: torch.Tensor) -> list[bytes]:
        raise NotImplementedError

    def decode_layer(self, name: str, data: bytes, offset: int, n: int) -> tuple[torch.Tensor, int]:
        raise NotImplementedError


class RefDense(Reference):
    def encode_layer(self, name, g):
        return _raw(g.float())

    def decode_layer(self, name, data, offset, n):
        return _take(data, offset, torch.float32, n)


class RefFp16(Reference):
    def encode_layer(self, name, g):
        return _raw(g.half())

    def decode_layer(self, name, data, offset, n):
        values, offset = _take(data, offset, torch.float16, n)
        return values.float(), offset


class RefSparse(Reference):
    """Indices (int32) + fp32 values; ``select`` differs per method."""

    def __init__(self, shapes, ratio: float = 0.01) -> None:
        super().__init__(shapes)
        self.ratio = ratio

    def k(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.ratio * n - 1e-9)))

    def select(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def encode_layer(self, name, g):
        flat = g.reshape(-1)
        idx = self.select(flat)
        return [int(idx.numel()).to_bytes(4, "little"), *_raw(idx.to(torch.int32), flat[idx])]

    def decode_layer(self, name, data, offset, n):
        k = int.from_bytes(data[offset : offset + 4], "little")
        idx, offset = _take(data, offset + 4, torch.int32, k)
        values, offset = _take(data, offset, torch.float32, k)
        return torch.zeros(n).index_put_((idx.long(),), values), offset


class RefTopK(RefSparse):
    def select(self, flat):
        return torch.topk(flat.abs(), self.k(flat.numel()), sorted=False).indices


class RefRandomK(RefSparse):
    def __init__(self, shapes, ratio=0.01, seed=0):
        super().__init__(shapes, ratio)
        self.gen = torch.Generator().manual_seed(seed)

    def select(self, flat):
        return torch.randperm(flat.numel(), generator=self.gen)[: self.k(flat.numel())]


class RefThreshold(RefSparse):
    def __init__(self, shapes, threshold: float) -> None:
        super().__init__(shapes)
        self.threshold = threshold

    def select(self, flat):
        return (flat.abs() >= self.threshold).nonzero().flatten()


class RefQSGD(Reference):
    """Bucketed QSGD with one int8 code per element (no bit packing)."""

    def __init__(self, shapes, levels=7, bucket_size=512, seed=0):
        super().__init__(shapes)
        self.levels, self.bucket = levels, bucket_size
        self.gen = torch.Generator().manual_seed(seed)

    def encode_layer(self, name, g):
        flat = g.reshape(-1)
        pad = (-flat.numel()) % self.bucket
        buckets = torch.nn.functional.pad(flat, (0, pad)).view(-1, self.bucket)
        norms = buckets.norm(dim=1, keepdim=True)
        scaled = torch.where(
            norms > 0, buckets.abs() / norms * self.levels, torch.zeros_like(buckets)
        )
        level = torch.floor(scaled + torch.rand(scaled.shape, generator=self.gen)).clamp_(
            max=self.levels
        )
        codes = (torch.sign(buckets) * level).to(torch.int8)
        return _raw(norms.flatten(), codes.flatten()[: flat.numel()])

    def decode_layer(self, name, data, offset, n):
        nb = -(-n // self.bucket)
        norms, offset = _take(data, offset, torch.float32, nb)
        codes, offset = _take(data, offset, torch.int8, n)
        scale = norms.repeat_interleave(self.bucket)[:n] / self.levels
        return codes.float() * scale, offset


class RefInt8(Reference):
    def __init__(self, shapes, block_size=256):
        super().__init__(shapes)
        self.block = block_size

    def encode_layer(self, name, g):
        flat = g.reshape(-1)
        pad = (-flat.numel()) % self.block
        blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, self.block)
        scale = blocks.abs().amax(dim=1, keepdim=True) / 127
        q = (
            torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks))
            .round()
            .clamp(-127, 127)
            .to(torch.int8)
        )
        return _raw(scale.flatten(), q.flatten()[: flat.numel()])

    def decode_layer(self, name, data, offset, n):
        nb = -(-n // self.block)
        scale, offset = _take(data, offset, torch.float32, nb)
        q, offset = _take(data, offset, torch.int8, n)
        return q.float() * scale.repeat_interleave(self.block)[:n], offset


class RefPowerSGD(Reference):
    def __init__(self, shapes, rank=4, seed=0):
        super().__init__(shapes)
        self.rank = rank
        self.gen = torch.Generator().manual_seed(seed)
        self.q: dict[str, torch.Tensor] = {}

    def _low_rank(self, shape) -> int:
        if len(shape) < 2:
            return 0
        rows, cols = shape[0], math.prod(shape[1:])
        r = min(self.rank, rows, cols)
        return r if (rows + cols) * r < rows * cols else 0

    def encode_layer(self, name, g):
        r = self._low_rank(tuple(g.shape))
        if r == 0:
            return _raw(g.reshape(-1))
        m = g.reshape(g.shape[0], -1)
        q = self.q.get(name)
        if q is None:
            q = torch.randn(m.shape[1], r, generator=self.gen)
        p = torch.linalg.qr(m @ q).Q
        q = m.T @ p
        self.q[name] = q
        return _raw(p, q)

    def decode_layer(self, name, data, offset, n):
        shape = self.shapes[name]
        r = self._low_rank(shape)
        if r == 0:
            return _take(data, offset, torch.float32, n)
        rows, cols = shape[0], n // shape[0]
        p, offset = _take(data, offset, torch.float32, rows * r)
        q, offset = _take(data, offset, torch.float32, cols * r)
        return (p.view(rows, r) @ q.view(cols, r).T).reshape(-1), offset


class RefSign(Reference):
    """Scaled sign, bits packed with torch ops."""

    WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)

    def encode_layer(self, name, g):
        flat = g.reshape(-1)
        scale = flat.abs().mean().reshape(1)
        bits = torch.nn.functional.pad((flat >= 0).to(torch.uint8), (0, (-flat.numel()) % 8)).view(
            -1, 8
        )
        packed = (bits * self.WEIGHTS).sum(dim=1).to(torch.uint8)
        return _raw(scale, packed)

    def decode_layer(self, name, data, offset, n):
        scale, offset = _take(data, offset, torch.float32, 1)
        packed, offset = _take(data, offset, torch.uint8, -(-n // 8))
        positive = (packed.unsqueeze(1) & self.WEIGHTS).ne(0).flatten()[:n]
        return torch.where(positive, scale, -scale), offset


class RefTopKEF(RefTopK):
    """Top-k with error feedback in plain torch."""

    def __init__(self, shapes, ratio=0.01):
        super().__init__(shapes, ratio)
        self.residual: dict[str, torch.Tensor] = {}

    def encode_layer(self, name, g):
        v = g + self.residual.get(name, torch.zeros_like(g))
        flat = v.reshape(-1)
        idx = self.select(flat)
        sent = torch.zeros_like(flat).index_put_((idx,), flat[idx])
        self.residual[name] = (flat - sent).view_as(g)
        return [int(idx.numel()).to_bytes(4, "little"), *_raw(idx.to(torch.int32), flat[idx])]


# ---- candidates ------------------------------------------------------------------------


@dataclass
class Case:
    label: str
    params: dict
    encode: Callable[[Grads], bytes]
    decode: Callable[[bytes], Grads]
    reference: Reference


def stateless_case(label: str, compressor: Compressor, reference: Reference, shapes) -> Case:
    return Case(
        label,
        {"compressor": compressor.name, **compressor.params()},
        lambda g: encode_tensors(g, compressor),
        lambda data: decode_tensors(data, shapes),
        reference,
    )


def build_cases(grads: Grads) -> list[Case]:
    shapes = {n: tuple(g.shape) for n, g in grads.items()}
    # Threshold set at the 99th percentile of |g| so it keeps about 1 %, like top-k.
    all_abs = torch.cat([g.abs().flatten() for g in grads.values()])
    tau = float(torch.kthvalue(all_abs, int(0.99 * all_abs.numel())).values)
    create = registry.create
    cases = [
        stateless_case("dense", create("dense"), RefDense(shapes), shapes),
        stateless_case("fp16", create("fp16"), RefFp16(shapes), shapes),
        stateless_case("topk 1%", create("topk", ratio=0.01), RefTopK(shapes, 0.01), shapes),
        stateless_case(
            "topk 1% fp16 values",
            create("topk", ratio=0.01, value_dtype="float16"),
            RefTopK(shapes, 0.01),
            shapes,
        ),
        stateless_case(
            "randomk 1%", create("randomk", ratio=0.01, seed=0), RefRandomK(shapes, 0.01, 0), shapes
        ),
        stateless_case(
            "threshold p99", create("threshold", threshold=tau), RefThreshold(shapes, tau), shapes
        ),
        stateless_case(
            "qsgd s=7", create("qsgd", levels=7, bucket_size=512), RefQSGD(shapes, 7, 512), shapes
        ),
        stateless_case(
            "int8_block 256", create("int8_block", block_size=256), RefInt8(shapes, 256), shapes
        ),
        stateless_case("powersgd r=4", create("powersgd", rank=4), RefPowerSGD(shapes, 4), shapes),
        stateless_case("sign", create("sign"), RefSign(shapes), shapes),
    ]
    codec = GradientCodec(create("topk", ratio=0.01), ErrorFeedback())
    cases.append(
        Case(
            "topk 1% + EF codec",
            {"compressor": "topk", "ratio": 0.01, "memory": "ErrorFeedback"},
            codec.encode,
            lambda data: codec.decode(data, shapes),
            RefTopKEF(shapes, 0.01),
        )
    )
    return cases


def time_round_trip(encode, decode, grads: Grads, inner: int) -> tuple[float, float, bytes, Grads]:
    """Mean encode and decode seconds over ``inner`` calls."""
    enc = dec = 0.0
    data, out = b"", {}
    for _ in range(inner):
        t0 = time.perf_counter()
        data = encode(grads)
        t1 = time.perf_counter()
        out = decode(data)
        t2 = time.perf_counter()
        enc += t1 - t0
        dec += t2 - t1
    return enc / inner, dec / inner, data, out


def rel_error(out: Grads, grads: Grads) -> float:
    num = math.sqrt(sum(float((out[n] - g).double().pow(2).sum()) for n, g in grads.items()))
    den = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    return num / den


def summarise(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_throughput(repeats: int, inner: int) -> dict:
    grads = real_gradient(seed=0)
    numel = sum(g.numel() for g in grads.values())
    dense_bytes = 4 * numel
    cases = build_cases(grads)
    raw: dict[str, dict] = {
        c.label: {
            "ours": {"encode_ms": [], "decode_ms": [], "mb_per_s": []},
            "reference": {"encode_ms": [], "decode_ms": [], "mb_per_s": []},
        }
        for c in cases
    }
    sizes: dict[str, dict] = {}
    for case in cases:  # warm up both paths once (allocations, lazy init) and record sizes / error
        _, _, data, out = time_round_trip(case.encode, case.decode, grads, 1)
        _, _, ref_data, ref_out = time_round_trip(
            case.reference.encode, case.reference.decode, grads, 1
        )
        sizes[case.label] = {
            "wire_bytes": len(data),
            "reference_bytes": len(ref_data),
            "ratio_vs_dense_fp32": dense_bytes / len(data),
            "reference_ratio_vs_dense_fp32": dense_bytes / len(ref_data),
            "rel_error": rel_error(out, grads),
            "reference_rel_error": rel_error(ref_out, grads),
        }
    for rep in range(repeats):
        for case in cases:
            # Alternate who goes first so drift on a shared machine hits both.
            order = [
                ("ours", case.encode, case.decode),
                ("reference", case.reference.encode, case.reference.decode),
            ]
            for side, enc, dec in order if rep % 2 == 0 else order[::-1]:
                e, d, _, _ = time_round_trip(enc, dec, grads, inner)
                raw[case.label][side]["encode_ms"].append(e * 1e3)
                raw[case.label][side]["decode_ms"].append(d * 1e3)
                raw[case.label][side]["mb_per_s"].append(dense_bytes / (e + d) / MB)
        print(f"  repeat {rep + 1}/{repeats} done", file=sys.stderr)
    results = {}
    for case in cases:
        entry = {"params": case.params, **sizes[case.label]}
        for side in ("ours", "reference"):
            figures = raw[case.label][side]
            entry[side] = {
                "raw": figures,
                "mb_per_s": summarise(figures["mb_per_s"]),
                "encode_ms": summarise(figures["encode_ms"]),
                "decode_ms": summarise(figures["decode_ms"]),
            }
        entry["speedup_vs_reference"] = (
            entry["ours"]["mb_per_s"]["median"] / entry["reference"]["mb_per_s"]["median"]
        )
        results[case.label] = entry
    return {
        "gradient": {
            "model": f"MLP {BENCH_WIDTHS} on digits, gradient of one batch of 64 after 30 SGD steps",
            "layers": {n: list(g.shape) for n, g in grads.items()},
            "numel": numel,
            "dense_fp32_bytes": dense_bytes,
        },
        "config": {
            "repeats": repeats,
            "inner_iterations": inner,
            "interleaved": "A B / B A alternating per repeat",
            "mb": "10^6 bytes of dense fp32 gradient",
        },
        "results": results,
    }


# ---- training comparison --------------------------------------------------------------

TRAIN_WIDTHS = [64, 256, 256, 10]


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train_once(mode: str, seed: int, cfg: dict) -> dict:
    """Simulated data-parallel SGD: each worker sends its gradient through its own
    codec, the server decodes, averages (equal batches) and steps. Same seed =
    same init, shards and batch order for both modes."""
    x, y, x_test, y_test = digits_split(seed)
    model = mlp(TRAIN_WIDTHS, seed)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    workers, batch = cfg["workers"], cfg["batch_per_worker"]
    if mode == "dense":
        codecs = [GradientCodec(registry.create("dense"), NoMemory()) for _ in range(workers)]
    else:
        codecs = [
            GradientCodec(registry.create("topk", ratio=cfg["ratio"]), ErrorFeedback())
            for _ in range(workers)
        ]
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
    rng = np.random.default_rng(seed)
    shards = np.array_split(rng.permutation(x.shape[0]), workers)
    cursors = [rng.permutation(s) for s in shards]
    positions = [0] * workers
    samples = wire_bytes = steps = 0
    checkpoints = sorted(set(cfg["checkpoints"]) | {cfg["samples"]})
    curve: dict[int, float] = {}
    while samples < cfg["samples"]:
        summed = {n: torch.zeros(s) for n, s in shapes.items()}
        for w in range(workers):
            if positions[w] + batch > cursors[w].size:
                cursors[w], positions[w] = rng.permutation(shards[w]), 0
            idx = torch.from_numpy(cursors[w][positions[w] : positions[w] + batch])
            positions[w] += batch
            model.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            data = codecs[w].encode({n: p.grad for n, p in model.named_parameters()})
            wire_bytes += len(data)
            for n, g in codecs[w].decode(data, shapes).items():
                summed[n] += g
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.grad = summed[n] / workers
        opt.step()
        samples += workers * batch
        steps += 1
        while checkpoints and samples >= checkpoints[0]:
            curve[checkpoints.pop(0)] = evaluate(model, x_test, y_test)
    return {
        "accuracy": curve[cfg["samples"]],
        "accuracy_at_samples": {str(k): v for k, v in curve.items()},
        "steps": steps,
        "samples": samples,
        "wire_bytes": wire_bytes,
    }


def run_training(seeds: list[int], cfg: dict) -> dict:
    runs: dict[str, list[dict]] = {"dense": [], "topk_ef": []}
    for seed in seeds:
        for mode in runs:
            result = train_once(mode, seed, cfg)
            runs[mode].append({"seed": seed, **result})
            print(f"  train {mode} seed {seed}: accuracy {result['accuracy']:.4f}", file=sys.stderr)
    dense_acc = [r["accuracy"] for r in runs["dense"]]
    topk_acc = [r["accuracy"] for r in runs["topk_ef"]]
    gaps = [d - t for d, t in zip(dense_acc, topk_acc, strict=True)]
    return {
        "config": {
            **cfg,
            "model": f"MLP {TRAIN_WIDTHS}",
            "parameters": sum(
                a * b + b for a, b in zip(TRAIN_WIDTHS, TRAIN_WIDTHS[1:], strict=False)
            ),
            "data": "sklearn digits, standardised, stratified 80/20 split per seed (held-out 20 % evaluated)",
            "seeds": seeds,
        },
        "runs": runs,
        "dense_accuracy": summarise(dense_acc) | {"mean": statistics.fmean(dense_acc)},
        "topk_ef_accuracy": summarise(topk_acc) | {"mean": statistics.fmean(topk_acc)},
        "gap_points": {
            "per_seed": [100 * g for g in gaps],
            "mean": 100 * statistics.fmean(gaps),
            "max": 100 * max(gaps),
        },
        "bytes_ratio": sum(r["wire_bytes"] for r in runs["dense"])
        / sum(r["wire_bytes"] for r in runs["topk_ef"]),
    }


# ---- reporting ------------------------------------------------------------------------


def machine() -> dict:
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def throughput_table(section: dict) -> str:
    lines = [
        "| compressor | wire bytes | x fewer than dense | ours MB/s (min-max) | reference MB/s (min-max) | ours / ref | ref bytes | rel. error ours / ref |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in section["results"].items():
        ours, ref = r["ours"]["mb_per_s"], r["reference"]["mb_per_s"]
        lines.append(
            f"| {label} | {r['wire_bytes']:,} | {r['ratio_vs_dense_fp32']:.1f} | "
            f"{ours['median']:.0f} ({ours['min']:.0f}-{ours['max']:.0f}) | "
            f"{ref['median']:.0f} ({ref['min']:.0f}-{ref['max']:.0f}) | {r['speedup_vs_reference']:.2f} | "
            f"{r['reference_bytes']:,} | {r['rel_error']:.3f} / {r['reference_rel_error']:.3f} |"
        )
    return "\n".join(lines)


def training_table(section: dict) -> str:
    lines = [
        "| seed | dense accuracy | top-k 1 % + EF accuracy | gap (points) |",
        "|---|---:|---:|---:|",
    ]
    for d, t, gap in zip(
        section["runs"]["dense"],
        section["runs"]["topk_ef"],
        section["gap_points"]["per_seed"],
        strict=True,
    ):
        lines.append(
            f"| {d['seed']} | {100 * d['accuracy']:.2f} | {100 * t['accuracy']:.2f} | {gap:+.2f} |"
        )
    lines.append(
        f"| mean | {100 * section['dense_accuracy']['mean']:.2f} | {100 * section['topk_ef_accuracy']['mean']:.2f} | "
        f"{section['gap_points']['mean']:+.2f} |"
    )
    return "\n".join(lines)


def curve_table(section: dict) -> str:
    points = list(section["runs"]["dense"][0]["accuracy_at_samples"])
    lines = [
        "| samples | " + " | ".join(f"{int(p):,}" for p in points) + " |",
        "|---|" + "---:|" * len(points),
    ]
    for mode, label in (
        ("dense", "dense (mean of seeds)"),
        ("topk_ef", "top-k 1 % + EF (mean of seeds)"),
    ):
        means = [
            statistics.fmean(r["accuracy_at_samples"][p] for r in section["runs"][mode])
            for p in points
        ]
        lines.append(f"| {label} | " + " | ".join(f"{100 * m:.2f}" for m in means) + " |")
    return "\n".join(lines)


def targets(report: dict) -> list[str]:
    notes = []
    if "throughput" in report:
        topk = report["throughput"]["results"]["topk 1%"]
        ratio, speed = topk["ratio_vs_dense_fp32"], topk["ours"]["mb_per_s"]["median"]
        notes.append(
            f"- top-k 1 % bytes vs dense fp32: {ratio:.1f}x (target >= 50x): {'met' if ratio >= 50 else 'NOT met'}"
        )
        notes.append(
            f"- top-k 1 % encode+decode: {speed:.0f} MB/s on one thread (target >= 200): {'met' if speed >= 200 else 'NOT met'}"
        )
    if "training" in report:
        t = report["training"]
        gap = t["gap_points"]["max"]
        notes.append(
            f"- accuracy after {t['config']['samples']:,} samples, dense vs top-k 1 % + EF: worst seed gap {gap:+.2f} points "
            f"(target within 1): {'met' if gap <= 1.0 else 'NOT met'}"
        )
    return notes


def write_markdown(report: dict) -> str:
    parts = [
        "# Compression benchmark",
        "",
        f"Machine: {report['machine']['cpu_model']} ({report['machine']['cpu_count']} CPUs, one torch thread), torch {report['machine']['torch']}, numpy {report['machine']['numpy']}.",
        "",
    ]
    if "throughput" in report:
        g = report["throughput"]["gradient"]
        c = report["throughput"]["config"]
        parts += [
            "## Encode + decode throughput and bytes per message",
            "",
            f"{g['model']}: {g['numel']:,} parameters, {g['dense_fp32_bytes']:,} dense fp32 bytes. "
            f"MB/s = 10^6 bytes of dense gradient per second of encode + decode, median of {c['repeats']} repeats "
            f"({c['inner_iterations']} round trips each), reference interleaved in the same run. "
            "Ours = `encode_tensors` / `decode_tensors` (framed, validated); reference = plain torch, raw bytes, no validation.",
            "",
            throughput_table(report["throughput"]),
            "",
        ]
    if "training" in report:
        t = report["training"]
        cfg = t["config"]
        parts += [
            "## Training comparison",
            "",
            f"{cfg['model']} ({cfg['parameters']:,} parameters), {cfg['workers']} simulated workers x {cfg['batch_per_worker']} samples, "
            f"SGD lr {cfg['lr']} momentum {cfg['momentum']}, {cfg['samples']:,} training samples; {cfg['data']}. "
            f"Top-k keeps {cfg['ratio']:.0%} per layer with per-worker error feedback. Bytes sent: dense / top-k = {t['bytes_ratio']:.1f}x.",
            "",
            training_table(t),
            "",
            "Held-out accuracy (%) along the way:",
            "",
            curve_table(t),
            "",
        ]
    parts += ["## Targets", "", *targets(report), ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--only-train", action="store_true")
    parser.add_argument("--train-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-samples", type=int, default=40_000)
    parser.add_argument("--out", type=Path, default=RESULTS / "compression.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    report: dict = {}
    if args.only_train and args.out.exists():
        report = json.loads(args.out.read_text())  # keep the throughput section
    report["benchmark"] = "compression"
    report["machine"] = machine()
    report["generated_unix_s"] = int(time.time())
    if not args.only_train:
        print("throughput ...", file=sys.stderr)
        report["throughput"] = run_throughput(args.repeats, args.inner)
    if not args.skip_train:
        print("training ...", file=sys.stderr)
        cfg = {
            "workers": 4,
            "batch_per_worker": 16,
            "lr": 0.05,
            "momentum": 0.9,
            "ratio": 0.01,
            "samples": args.train_samples,
            "checkpoints": [c for c in (2_500, 5_000, 10_000, 20_000) if c < args.train_samples],
        }
        report["training"] = run_training(args.train_seeds, cfg)
    report["targets"] = targets(report)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    markdown = write_markdown(report)
    args.out.with_suffix(".md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
