"""Linear layer y = x Wᵀ + b and its backward on the GEMMs of kernels/linear.wgsl."""

from __future__ import annotations

import os

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect
from mambactl.ops.reduce import column_sums
from mambactl.runtime.tensor import Tensor

_TILES = {"matmul": 64, "matmul_large": 128, "matmul_direct": 64}
_FILL_GROUPS = 512  # fewer output tiles than this: split K across workgroups (then sum the planes)
_MIN_SPLIT_K = 512  # each split's K range is at least this long
_DEFAULT_GPU_KERNEL = os.environ.get("MAMBACTL_GEMM", "matmul_large")  # benchmarks compare kernels with it


def _choose(rt, M: int, N: int, kernel: str | None) -> str:
    if kernel is not None:
        return kernel
    if rt.info.type == "CPU":
        return "matmul_direct"
    if _DEFAULT_GPU_KERNEL == "matmul_large" and M * N < 128 * 128 * 256:
        return "matmul"  # a small output gives too few 128×128 tiles to fill the GPU
    return _DEFAULT_GPU_KERNEL


def matmul(a: Tensor, b: Tensor, *, trans_a=False, trans_b=False, bias: Tensor | None = None, out: Tensor | None = None,
           kernel: str | None = None, split_k: int | None = None) -> Tensor:
    """C[M, N] = op(A) op(B) (+ bias); A is [M, K] ([K, M] if trans_a), B is [K, N] ([N, K] if trans_b).

    With `out`, the product is added into it (gradient accumulation). `kernel` forces "matmul",
    "matmul_large" or "matmul_direct" (default: by adapter type and size); `split_k` forces the number of
    K slices (default: enough to fill the GPU when the output has few tiles and K is long)."""
    expect("matmul", "a", a)
    expect("matmul", "b", b)
    if a.ndim != 2 or b.ndim != 2:
        raise ShapeError(f"matmul: a and b must be 2-D, got {a.shape} and {b.shape}")
    M, K = (a.shape[1], a.shape[0]) if trans_a else a.shape
    Kb, N = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if K != Kb:
        raise ShapeError(f"matmul: inner dims differ: a {a.shape}{'ᵀ' if trans_a else ''} vs b {b.shape}{'ᵀ' if trans_b else ''}")
    if min(M, N, K) < 1:
        raise ShapeError(f"matmul: empty product of {a.shape} and {b.shape}")
    if bias is not None:
        expect("matmul", "bias", bias, (N,))
    if out is not None:
        expect("matmul", "out", out, (M, N))
    rt = a.runtime
    entry = _choose(rt, M, N, kernel)
    tile = _TILES[entry]
    groups = (-(-N // tile), -(-M // tile))
    if split_k is None:
        tiles = groups[0] * groups[1]
        split_k = 1 if bias is not None or rt.info.type == "CPU" else max(1, min(_FILL_GROUPS // tiles, K // _MIN_SPLIT_K))
    k_split = -(-(-(-K // split_k)) // 16) * 16  # a multiple of every kernel's K tile
    splits = max(1, -(-K // k_split))
    if splits == 1:
        accumulate = out is not None
        if out is None:
            out = rt.empty((M, N))
        consts = {"TRANS_A": trans_a, "TRANS_B": trans_b, "HAS_BIAS": bias is not None, "ACCUMULATE": accumulate}
        rt.run(entry, groups, consts, a=a, b=b, bias=bias if bias is not None else a, c=out, m=M, n=N, k=K,
               k_split=max(K, 1))
        return out
    if bias is not None:
        raise ShapeError("matmul: split-K with a bias is not supported")
    planes = rt.empty((splits, M, N))
    consts = {"TRANS_A": trans_a, "TRANS_B": trans_b, "HAS_BIAS": False, "ACCUMULATE": False}
    rt.run(entry, groups + (splits,), consts, a=a, b=b, bias=a, c=planes, m=M, n=N, k=K, k_split=k_split)
    summed = column_sums(planes.reshape(splits, M * N), None if out is None else out.reshape(M * N))
    return out if out is not None else summed.reshape(M, N)


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """x [M, K], w [N, K], b [N] -> [M, N]."""
    expect("linear", "x", x, (None, None))
    expect("linear", "w", w, (None, x.shape[1]))
    return matmul(x, w, trans_b=True, bias=b)


def bias_backward(dy: Tensor, out: Tensor | None = None) -> Tensor:
    """db [N] (+)= Σ_m dy[m, :]."""
    expect("bias_backward", "dy", dy, (None, None))
    return column_sums(dy, out)


def linear_backward(x: Tensor, w: Tensor, dy: Tensor, *, dw: Tensor | None = None, db: Tensor | None = None,
                    need_dx: bool = True, has_bias: bool = False):
    """-> (dx [M, K] = dy w, dw [N, K] (+)= dyᵀ x, db [N] (+)= Σ dy or None). Pass dw/db to accumulate."""
    expect("linear_backward", "dy", dy, (x.shape[0], w.shape[0]))
    dx = matmul(dy, w) if need_dx else None
    dw = matmul(dy, x, trans_a=True, out=dw)
    dbias = bias_backward(dy, db) if (has_bias or db is not None) else None
    return dx, dw, dbias
