"""Causal depthwise conv1d with PyTorch taps (kernels/conv1d.wgsl), and conv1d followed by SiLU (Mamba's
x branch) with its backward, which the walks (CPU adapters) fuse into one dispatch each way."""

from __future__ import annotations

from mambactl.ops import activations
from mambactl.ops.checks import SEGMENT_BUDGET, expect, grid_1d, is_cpu
from mambactl.ops.reduce import column_sums
from mambactl.runtime.tensor import Tensor


def _dims(op: str, x: Tensor, w: Tensor):
    expect(op, "x", x, (None, None, None))
    B, L, C = x.shape
    expect(op, "w", w, (C, None))
    return B, L, C, w.shape[1]


_BLOCK_ROWS = 256
WALK_MAX_TAPS = 4  # the walks hold the taps and the window in vec4 registers


def _walk(rt, L: int, K: int, walk: bool | None) -> bool:
    """The *_walk kernels (one invocation per (batch row, channel) walking time): on CPU adapters, for K ≤ 4 and a
    walk within llvmpipe's loop budget; `walk` forces them (True) or the per-output kernels (False)."""
    if walk is None:
        return is_cpu(rt) and K <= WALK_MAX_TAPS and L + K <= SEGMENT_BUDGET
    return bool(walk)


def conv1d(x: Tensor, w: Tensor, b: Tensor, walk: bool | None = None) -> Tensor:
    """x [B, L, C], w [C, K] (the [C, 1, K] weight flattened), b [C] -> y [B, L, C]. `walk`: see _walk."""
    return _forward("conv1d", x, w, b, walk, silu=False)[0]


def conv1d_silu(x: Tensor, w: Tensor, b: Tensor, walk: bool | None = None) -> tuple[Tensor, Tensor]:
    """-> (y, SiLU(y)) with y = conv1d(x, w, b). The walk writes both in one dispatch; the per-output path runs
    conv1d_forward then silu_forward."""
    return _forward("conv1d_silu", x, w, b, walk, silu=True)


def _forward(op: str, x: Tensor, w: Tensor, b: Tensor, walk: bool | None, silu: bool) -> tuple[Tensor, Tensor | None]:
    B, L, C, K = _dims(op, x, w)
    expect(op, "b", b, (C,))
    rt = x.runtime
    y = rt.empty(x.shape)
    dims = dict(x=x, w=w, bias=b, y=y, batch=B, len=L, channels=C, taps=K, block_rows=0)
    if _walk(rt, L, K, walk):
        act = rt.empty(x.shape) if silu else y  # without SILU the walk never writes act
        rt.run("conv1d_forward_walk", grid_1d(B * C, 64), {"SILU": silu}, act=act, **dims)
        return y, act if silu else None
    rt.run("conv1d_forward", grid_1d(x.size), **dims)
    return y, activations.silu(y) if silu else None


def conv1d_backward(x: Tensor, w: Tensor, dy: Tensor, dw: Tensor | None = None, db: Tensor | None = None,
                    walk: bool | None = None):
    """-> (dx [B, L, C], dw [C, K], db [C]); pass dw and db together to accumulate into them. `walk`: see _walk."""
    return _backward("conv1d_backward", x, w, dy, None, dw, db, walk)


def conv1d_silu_backward(x: Tensor, w: Tensor, y: Tensor, dact: Tensor, dact2: Tensor, dw: Tensor | None = None,
                         db: Tensor | None = None, walk: bool | None = None):
    """Backward of act = SiLU(y), y = conv1d(x, w, b), where act has two consumers whose gradients are dact and
    dact2 (x [B, L, C], y the forward's conv output) -> (dx, dw, db) as conv1d_backward. The walk folds the add
    and silu_backward into its dispatch; the per-output path runs add_forward, silu_backward, then the conv's."""
    return _backward("conv1d_silu_backward", x, w, dact, (y, dact2), dw, db, walk)


def _backward(op: str, x: Tensor, w: Tensor, dy: Tensor, silu: tuple[Tensor, Tensor] | None, dw: Tensor | None,
              db: Tensor | None, walk: bool | None):
    B, L, C, K = _dims(op, x, w)
    names = ("dy",) if silu is None else ("dact", "y", "dact2")
    for name, t in zip(names, (dy,) + (silu or ())):
        expect(op, name, t, x.shape)
    if dw is not None or db is not None:
        expect(op, "dw", dw, (C, K))
        expect(op, "db", db, (C,))
    rt = x.runtime
    dx = rt.empty(x.shape)
    dims = dict(batch=B, len=L, channels=C, taps=K, block_rows=_BLOCK_ROWS)
    if _walk(rt, L, K, walk):  # dx and the per-batch-row partials of dw and db in one walk
        dw_part, db_part = rt.empty((B, C * K)), rt.empty((B, C))
        pre, dy2 = silu if silu is not None else (x, dy)  # without SILU the walk never reads them
        rt.run("conv1d_backward_walk", grid_1d(B * C, 64), {"SILU": silu is not None}, x=x, w=w, dy=dy, dx=dx,
               dw_part=dw_part, db_part=db_part, pre=pre, dy2=dy2, **dims)
    else:
        if silu is not None:
            dy = activations.silu_backward(silu[0], activations.add(dy, silu[1]))
        rt.run("conv1d_backward_input", grid_1d(x.size), w=w, dy=dy, dx=dx, **dims)
        blocks = -(-(B * L) // _BLOCK_ROWS)
        dw_part, db_part = rt.empty((blocks, C * K)), rt.empty((blocks, C))
        rt.run("conv1d_backward_weight", (-(-C // 64), K, blocks), x=x, dy=dy, dw_part=dw_part, db_part=db_part,
               **dims)
    dw = column_sums(dw_part, None if dw is None else dw.reshape(C * K)).reshape(C, K)
    return dx, dw, column_sums(db_part, db)


def conv1d_state(x: Tensor, taps: int) -> Tensor:
    """x [B, L, C] -> the decoding state [B, K − 1, C]: the last K − 1 inputs, oldest first (zeros before t = 0)."""
    expect("conv1d_state", "x", x, (None, None, None))
    B, L, C = x.shape
    state = x.runtime.empty((B, max(taps - 1, 1), C))
    if taps > 1:
        x.runtime.run("conv1d_state", grid_1d(B * (taps - 1) * C), x=x, conv_state=state, batch=B, len=L,
                      channels=C, taps=taps, block_rows=0)
    return state


def conv1d_step(state: Tensor, x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """One decoding step: x [B, C], w [C, K], b [C]; state [B, K − 1, C] is shifted in place. -> y [B, C]."""
    expect("conv1d_step", "x", x, (None, None))
    B, C = x.shape
    expect("conv1d_step", "w", w, (C, None))
    K = w.shape[1]
    expect("conv1d_step", "state", state, (B, max(K - 1, 1), C))
    expect("conv1d_step", "b", b, (C,))
    y = x.runtime.empty((B, C))
    x.runtime.run("conv1d_step", grid_1d(B * C), x=x, w=w, bias=b, conv_state=state, y=y, batch=B, len=1,
                  channels=C, taps=K, block_rows=0)
    return y
