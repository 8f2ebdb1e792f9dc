"""Linear layer y = x Wᵀ + b and its backward on the tiled GEMM of kernels/linear.wgsl."""

from __future__ import annotations

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect
from mambactl.ops.reduce import column_sums
from mambactl.runtime.tensor import Tensor

_TILE = 64


def matmul(a: Tensor, b: Tensor, *, trans_a=False, trans_b=False, bias: Tensor | None = None, out: Tensor | None = None,
           kernel: str | None = None) -> Tensor:
    """C[M, N] = op(A) op(B) (+ bias); A is [M, K] ([K, M] if trans_a), B is [K, N] ([N, K] if trans_b).
    With `out`, the product is added into it (gradient accumulation). `kernel` forces "matmul" (tiled through
    workgroup memory, for GPUs) or "matmul_direct" (no barriers, for CPU adapters); default: by adapter type."""
    expect("matmul", "a", a)
    expect("matmul", "b", b)
    if a.ndim != 2 or b.ndim != 2:
        raise ShapeError(f"matmul: a and b must be 2-D, got {a.shape} and {b.shape}")
    M, K = (a.shape[1], a.shape[0]) if trans_a else a.shape
    Kb, N = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if K != Kb:
        raise ShapeError(f"matmul: inner dims differ: a {a.shape}{'ᵀ' if trans_a else ''} vs b {b.shape}{'ᵀ' if trans_b else ''}")
    if bias is not None:
        expect("matmul", "bias", bias, (N,))
    rt = a.runtime
    accumulate = out is not None
    if accumulate:
        expect("matmul", "out", out, (M, N))
    else:
        out = rt.empty((M, N))
    consts = {"TRANS_A": trans_a, "TRANS_B": trans_b, "HAS_BIAS": bias is not None, "ACCUMULATE": accumulate}
    groups = (-(-N // _TILE), -(-M // _TILE))
    entry = kernel or ("matmul_direct" if rt.info.type == "CPU" else "matmul")
    rt.run(entry, groups, consts, a=a, b=b, bias=bias if bias is not None else a, c=out, m=M, n=N, k=K)
    return out


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
