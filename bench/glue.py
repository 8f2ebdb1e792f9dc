"""The passes between the big kernels, alone: GPU time per call of conv1d (+ SiLU), the norms, the optimizer.

    python bench/glue.py [--batch 8] [--seq 1024] [--repeats 5] [--only conv,optim,...] [--device D]

Each case runs once to compile, then `--repeats` times with every dispatch timed by GPU timestamps
(`Runtime.gpu_times`, needs `timestamp-query`); a row gives the median over repeats of the case's summed GPU time
and its dispatches. Shapes are the 130m models' (d_model 768, d_inner 1536; Mamba-2 conv_dim 1792, 24 heads).
Variants (walk segment lengths, the old per-output path) run side by side in one process, so they compare.
"""

from __future__ import annotations

import argparse
import json
import statistics

from common import commit  # first: it puts the checkout on sys.path

import numpy as np  # noqa: E402

from mambactl.ops import adamw, conv1d, cross_entropy, fill, reduce, rmsnorm, rmsnorm_gated  # noqa: E402
from mambactl.runtime.arena import Arena  # noqa: E402
from mambactl.runtime.gpu import get_runtime  # noqa: E402


def timed(rt, fn, repeats: int) -> tuple[float, int]:
    """-> (median GPU ms of fn's dispatches, dispatches per call)."""
    fn()
    rt.sync()
    totals, count = [], 0
    for _ in range(repeats):
        rt.gpu_times = []
        fn()
        rt.sync()
        totals.append(sum(ns for _, _, ns in rt.gpu_times) * 1e-6)
        count = len(rt.gpu_times)
        rt.gpu_times = None
    return statistics.median(totals), count


def conv_cases(rt, rng, B, L):
    def normal(*shape):
        return rt.from_numpy(rng.standard_normal(shape).astype(np.float32))

    cases = {}
    for arch, width, start, C, two in (("mamba1", 3072, 0, 1536, True), ("mamba2", 3352, 1536, 1792, False)):
        xz, w, b = normal(B, L, width), normal(C, 4), normal(C)
        dact, dact2 = normal(B, L, C), normal(B, L, C) if two else None
        dw, db = normal(C, 4), normal(C)
        dxz = rt.empty((B, L, width))
        for seg in SEGMENTS:
            walk = seg is not None
            label = f"{arch} conv1d_silu {'walk seg ' + str(seg) if walk else 'per-output'}"
            kw = dict(x_start=start, walk=walk, segment=seg)
            cases[label + " fwd"] = lambda kw=kw, xz=xz, w=w, b=b: conv1d.conv1d_silu(xz, w, b, **kw)
            cases[label + " bwd"] = (lambda kw=kw, xz=xz, w=w, b=b, dact=dact, dact2=dact2, dw=dw, db=db, dxz=dxz:
                                     conv1d.conv1d_silu_backward(xz, w, b, dact, dact2, dw, db, dx_out=(dxz, start),
                                                                 **kw))
    return cases


def norm_cases(rt, rng, B, L):
    def normal(*shape):
        return rt.from_numpy(rng.standard_normal(shape).astype(np.float32))

    M, D, Di, W = B * L, 768, 1536, 3352  # Mamba-2: z in columns [0, 1536) of the 3352-wide in_proj output
    x, res, w, dy, dw = normal(M, D), normal(M, D), normal(D), normal(M, D), normal(D)
    _, _, rstd = rmsnorm.add_rmsnorm(x, res, w)
    y, zx, wg, dout, dwg = normal(M, Di), normal(M, W), normal(Di), normal(M, Di), normal(Di)
    dzx = rt.empty((M, W))
    _, rstd_g = rmsnorm_gated.rmsnorm_gated(y, zx, wg, Di, z_start=0)
    return {
        "rmsnorm fwd": lambda: rmsnorm.rmsnorm(x, w),
        "add_rmsnorm fwd": lambda: rmsnorm.add_rmsnorm(x, res, w),
        "rmsnorm bwd (+ dw sums)": lambda: rmsnorm.rmsnorm_backward(x, w, rstd, dy, dw),
        "rmsnorm bwd add_to (+ dw sums)": lambda: rmsnorm.rmsnorm_backward(x, w, rstd, dy, dw, add_to=res),
        "rmsnorm_gated fwd (z columns)": lambda: rmsnorm_gated.rmsnorm_gated(y, zx, wg, Di, z_start=0),
        "rmsnorm_gated bwd (z, dz columns, + dw sums)": lambda: rmsnorm_gated.rmsnorm_gated_backward(
            y, zx, wg, rstd_g, Di, dout, dwg, z_start=0, dz_out=(dzx, 0)),
    }


def optim_cases(rt, rng, B, L):
    """The optimizer's passes over a 130m-sized gradient Arena (129,135,360 elements, one decay class)."""
    n = 129_135_360 if B * L >= 8192 else 1_000_000  # small runs (lavapipe) check the code path
    arena = [Arena(rt, [(n,)]).tensors[0] for _ in range(4)]  # params, grads, m, v
    p, g, m, v = arena
    rt.write(g, rng.standard_normal(n).astype(np.float32) * 1e-3)
    state = adamw.AdamWState([m], [v], adamw._zero_counters(rt))
    return {
        "fill (one 129M-element arena)": lambda: fill.fill(p, 0.0),
        "sum_of_squares": lambda: reduce.sum_of_squares([g]),
        "adamw_step (norm + vec4 update)": lambda: adamw.adamw_step([p], [g], state, lr=1e-4, weight_decay=0.1,
                                                                    max_grad_norm=1.0),
    }


def ce_cases(rt, rng, B, L):
    M, V = B * L, 50280
    logits = rt.from_numpy(rng.random((M, V), dtype=np.float32) * 8.0)  # uniform: 412M normals take seconds
    targets = rt.from_numpy(rng.integers(0, V, M).astype(np.int32))
    _, lse = cross_entropy.cross_entropy(logits, targets, M)
    return {"cross_entropy fwd": lambda: cross_entropy.cross_entropy(logits, targets, M),
            "cross_entropy bwd": lambda: cross_entropy.cross_entropy_backward(logits, targets, lse, M)}


SEGMENTS = [8, 16, 32, 64, 128, None]  # walk segment lengths; None: the per-output kernels (--segments sets it)
GROUPS = {"conv": conv_cases, "norm": norm_cases, "optim": optim_cases, "ce": ce_cases}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", default=",".join(GROUPS))
    p.add_argument("--segments", default=None, help="conv walk segments, e.g. 32,64,128 (0: the per-output path)")
    p.add_argument("--device", default=None)
    a = p.parse_args()
    if a.segments:
        SEGMENTS[:] = [int(v) or None for v in a.segments.split(",")]
    rt = get_runtime(a.device)
    if "timestamp-query" not in rt.features:
        raise SystemExit(f"{rt.info.name} has no timestamp-query feature")
    rng = np.random.default_rng(0)
    results = {}
    for group in a.only.split(","):
        for label, fn in GROUPS[group](rt, rng, a.batch, a.seq).items():
            ms, n = timed(rt, fn, a.repeats)
            results[label] = [round(ms, 4), n]
            print(f"{label:56s} {ms:8.3f} ms  {n:3d} dispatches", flush=True)
    print(json.dumps({"bench": "glue", "commit": commit(), "device": rt.info.name, "batch": a.batch, "seq": a.seq,
                      "cases": results}))


if __name__ == "__main__":
    main()
