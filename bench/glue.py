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

from mambactl.ops import conv1d  # noqa: E402
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
        for seg in (8, 16, 32, 64, 128, None):
            walk = seg is not None
            label = f"{arch} conv1d_silu {'walk seg ' + str(seg) if walk else 'per-output'}"
            kw = dict(x_start=start, walk=walk, segment=seg)
            cases[label + " fwd"] = lambda kw=kw, xz=xz, w=w, b=b: conv1d.conv1d_silu(xz, w, b, **kw)
            cases[label + " bwd"] = (lambda kw=kw, xz=xz, w=w, b=b, dact=dact, dact2=dact2, dw=dw, db=db, dxz=dxz:
                                     conv1d.conv1d_silu_backward(xz, w, b, dact, dact2, dw, db, dx_out=(dxz, start),
                                                                 **kw))
    return cases


GROUPS = {"conv": conv_cases}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", default=",".join(GROUPS))
    p.add_argument("--device", default=None)
    a = p.parse_args()
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
