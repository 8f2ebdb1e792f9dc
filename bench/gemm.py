"""GEMM throughput by shape, kernel and direction (TFLOP/s; warm, median of repeats).

    python bench/gemm.py [--device D] [--shapes 4096x4096x4096,8192x768x3072,...] [--kernels auto,matmul@128x128/c]
                         [--repeats 7] [--src OTHER_CHECKOUT] [--out FILE]

A shape is MxKxN for Y[M, N] = X[M, K] · W[N, K]ᵀ (the forward of a linear layer), and each kernel is also
timed on the two backward products: dX[M, K] = dY W and dW[N, K] = dYᵀ X. The forward is timed as
`ops.linear.linear` runs it: where `transposes_weight` says so (GPUs, M ≥ TRANSPOSE_MIN_ROWS) on a copy of Wᵀ
made in each call (the transpose's time included end to end; the kernel-alone figure is the GEMM's), else on W;
mode `/nt` forces W. A kernel is `auto` (what
`ops.linear.matmul` picks), `matmul@TILE` (the tiled kernel with a tile of ops.linear.TILES),
with modes appended (to `auto` too): `/scalar` (its scalar loads), `/r` or `/c` (workgroup x walks row or column
tiles), `/kN` (N K slices), `/f16` (precision f16: matmul_f16, its two operand_amax passes included in the
time), `/flN` (f16 partial sums of N k steps), `/sN` (N 16-k slices per f16 shared tile), `/nt` (the forward on W, not Wᵀ), or any other name, passed as `kernel=` (e.g. `matmul_direct`, or an older commit's
kernels through --src). `--gpu-times` also times one call of each with GPU timestamps and prints the
nanoseconds per entry point (the GEMM kernel alone, apart from the f16 mode's amax passes). Each sample records enough calls back to back to take
≥ 20 ms, then syncs once, so submit and readback latency stay out of the figure; the first sample is a
warm-up (pipeline compilation, allocations) and is excluded. One JSON line per (shape, kernel), then a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

MODEL_SHAPES = "4096x4096x4096,8192x768x3072,8192x1536x768,8192x768x50280,8192x1536x80"
NAMES = {"4096x4096x4096": "square", "8192x768x3072": "in_proj", "8192x1536x768": "out_proj",
         "8192x768x50280": "tied head", "8192x1536x80": "x_proj"}
DIRECTIONS = ("fwd", "dX", "dW")


def kwargs_for(spec: str) -> dict:
    base, *modes = spec.split("/")
    if base == "auto":
        kw = {}
    elif base.startswith("matmul@"):
        kw = {"kernel": "matmul", "tile": base[len("matmul@"):]}
    else:
        return {"kernel": spec}
    for mode in modes:
        if mode == "scalar":
            kw["vec4"] = False
        elif mode in ("r", "c"):
            kw["raster"] = mode == "r"
        elif mode == "f16":
            kw["precision"] = "f16"
            if "kernel" in kw:
                kw["kernel"] = "matmul_f16"
        elif mode.startswith("fl"):
            kw["flush"] = int(mode[2:])
        elif mode.startswith("s"):
            kw["subtiles"] = int(mode[1:])
        elif mode.startswith("k"):
            kw["split_k"] = int(mode[1:])
        elif mode == "nt":
            kw["transpose_weight"] = False
    return kw


def timed(rt, fn, repeats: int, min_s: float = 0.02) -> float:
    """Seconds per call: median over `repeats` samples of `inner` calls each, after one warm-up sample."""
    t = time.perf_counter()
    fn()
    rt.sync()
    first = time.perf_counter() - t
    inner = max(1, min(50, int(min_s / max(first, 1e-6))))
    t = time.perf_counter()
    for _ in range(inner):
        fn()
    rt.sync()
    inner = max(1, min(50, int(min_s * inner / max(time.perf_counter() - t, 1e-6))))
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        rt.sync()
        out.append((time.perf_counter() - t) / inner)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None)
    p.add_argument("--shapes", default=MODEL_SHAPES)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--kernels", default="auto")
    p.add_argument("--src", default=None, help="import mambactl from this checkout (compare an older commit)")
    p.add_argument("--label", default="", help="tag the JSON lines and table rows (e.g. the commit)")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--gpu-times", action="store_true", help="also GPU-time one call per entry point (timestamps)")
    p.add_argument("--set", action="append", default=[], metavar="OP.NAME=VALUE", help="as bench/train_step.py's")
    a = p.parse_args()
    sys.path.insert(0, str(Path(a.src).resolve() if a.src else Path(__file__).resolve().parent.parent))
    import mambactl  # noqa: F401  (from --src, before common puts this checkout on sys.path)
    from common import apply_sets

    apply_sets(p, a.set)

    import numpy as np

    from mambactl.ops.linear import matmul
    try:
        from mambactl.ops.linear import transposes_weight
        from mambactl.ops.transpose import transpose
    except ImportError:  # an older checkout (--src): its forward is always on W
        transposes_weight = transpose = None
    from mambactl.runtime.gpu import get_runtime

    rt = get_runtime(a.device)
    rng = np.random.default_rng(0)
    print(f"{rt.info.name} ({rt.info.backend}) {a.label}", flush=True)
    rows = []
    for shape in a.shapes.split(","):
        M, K, N = (int(s) for s in shape.split("x"))
        x = rt.from_numpy(rng.standard_normal((M, K), dtype=np.float32))
        w = rt.from_numpy(rng.standard_normal((N, K), dtype=np.float32))
        dy = rt.from_numpy(rng.standard_normal((M, N), dtype=np.float32))
        flops = 2.0 * M * N * K
        for spec in a.kernels.split(","):
            kw = kwargs_for(spec)
            wt = kw.pop("transpose_weight", transposes_weight is not None and transposes_weight(rt, M))
            row = {"bench": "gemm", "label": a.label, "shape": shape, "kernel": spec, "fwd_on_wt": wt}
            for name, fn in (("fwd", lambda: matmul(x, transpose(w), **kw) if wt else matmul(x, w, trans_b=True, **kw)),
                             ("dX", lambda: matmul(dy, w, **kw)),
                             ("dW", lambda: matmul(dy, x, trans_a=True, **kw))):
                try:
                    row[name + "_tflops"] = round(flops / timed(rt, fn, a.repeats) / 1e12, 3)
                    if a.gpu_times:
                        rt.sync()
                        rt.gpu_times = []
                        fn()
                        rt.sync()
                        per_entry: dict = {}
                        for entry, _, ns in rt.gpu_times:
                            per_entry[entry] = per_entry.get(entry, 0) + ns
                        rt.gpu_times = None
                        row[name + "_gpu_us"] = {e: round(ns / 1e3, 1) for e, ns in per_entry.items()}
                        gemm_ns = sum(ns for e, ns in per_entry.items() if e.startswith("matmul"))
                        row[name + "_kernel_tflops"] = round(flops / gemm_ns / 1e3, 3) if gemm_ns else None
                except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others
                    row[name + "_error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
            line = json.dumps(row)
            print(line, flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(line + "\n")
        x = w = dy = None  # free the operands before the next shape
    print(f"\n| M×K×N | kernel | {' | '.join(DIRECTIONS)} |  (TFLOP/s{', ' + a.label if a.label else ''}"
          f"{'; in brackets the GEMM kernel alone, GPU timestamps' if a.gpu_times else ''})")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[d + '_tflops']:.1f}" if d + "_tflops" in r else "err" for d in DIRECTIONS]
        cells = [c + (f" ({r[d + '_kernel_tflops']:.1f})" if r.get(d + "_kernel_tflops") else "")
                 for c, d in zip(cells, DIRECTIONS)]
        name = NAMES.get(r["shape"])
        print(f"| {r['shape']}{f' ({name})' if name else ''} | {r['kernel']} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
