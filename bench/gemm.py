"""GEMM throughput by shape for both WGSL matmul kernels (TFLOP/s; warm, median of repeats).

    python bench/gemm.py [--device D] [--shapes 4096x4096x4096,8192x768x1536,...] [--repeats 10]

A shape is MxKxN for Y[M, N] = X[M, K] · W[N, K]ᵀ (the forward of a linear layer), and each kernel is also
timed on the two backward products (dX = dY W, dW = dYᵀ X).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from mambactl.ops.linear import matmul  # noqa: E402
from mambactl.runtime.gpu import get_runtime  # noqa: E402

MODEL_SHAPES = "4096x4096x4096,8192x768x3072,8192x1536x768,8192x768x50280,8192x1536x80"


def timed(rt, fn, repeats):
    fn()
    rt.sync()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        rt.sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None)
    p.add_argument("--shapes", default=MODEL_SHAPES)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--kernels", default="matmul,matmul_direct")
    a = p.parse_args()
    rt = get_runtime(a.device)
    rng = np.random.default_rng(0)
    print(f"{rt.info.name} ({rt.info.backend})")
    for shape in a.shapes.split(","):
        M, K, N = (int(s) for s in shape.split("x"))
        x = rt.from_numpy(rng.standard_normal((M, K), dtype=np.float32))
        w = rt.from_numpy(rng.standard_normal((N, K), dtype=np.float32))
        dy = rt.from_numpy(rng.standard_normal((M, N), dtype=np.float32))
        flops = 2.0 * M * N * K
        for kernel in a.kernels.split(","):
            row = {"shape": shape, "kernel": kernel}
            for name, fn in (("fwd", lambda: matmul(x, w, trans_b=True, kernel=kernel)),
                             ("dX", lambda: matmul(dy, w, kernel=kernel)),
                             ("dW", lambda: matmul(dy, x, trans_a=True, kernel=kernel))):
                row[name + "_tflops"] = round(flops / timed(rt, fn, a.repeats) / 1e12, 3)
            print(json.dumps(row))


if __name__ == "__main__":
    main()
