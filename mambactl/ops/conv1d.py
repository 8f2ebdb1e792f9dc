"""Causal depthwise conv1d with PyTorch taps (kernels/conv1d.wgsl), and conv1d followed by SiLU (Mamba's x
branch) with its backward, each one dispatch (plus the weight-gradient sums) on every adapter for K ≤ 4.

The input may be a column range of a wider matrix: x [B, L, P] with the conv's C = w.shape[0] channels in columns
[x_start, x_start + C) (Mamba's in_proj output, read in place instead of a column_slice copy); likewise the input
gradient can be written into columns of an existing matrix (`dx_out`, the combined in_proj gradient).
"""

from __future__ import annotations

from mambactl.errors import ShapeError
from mambactl.ops import activations
from mambactl.ops.checks import SEGMENT_BUDGET, expect, expect_columns, grid_1d, is_cpu
from mambactl.ops.reduce import column_sums
from mambactl.ops.slice import column_concat, column_split
from mambactl.runtime.tensor import Tensor

_BLOCK_ROWS = 256
WALK_MAX_TAPS = 4  # the walks hold the taps and the window in vec4 registers
# Steps per walk invocation on GPUs: B·C·L / GPU_SEGMENT threads (8·1536·16 = 197k at the 130m shape) keep
# enough loads in flight (four per thread, see conv1d.wgsl); each segment re-walks K − 1 steps to fill its window
# (H200, B 8, L 1024, Mamba-1 widths, with the four-step loads: forward 0.040 / 0.038 / 0.048 ms and backward with its
# weight sums 0.102 / 0.102 / 0.094 ms at 32 / 64 / 128 steps; before them 0.16 and 0.52 ms at 64).
GPU_SEGMENT = 64


def _dims(op: str, x: Tensor, w: Tensor, x_start: int):
    """-> (B, L, C, K, x_stride) for x [B, L, P] whose columns [x_start, x_start + C) are the conv's channels."""
    expect(op, "w", w, (None, None))
    C, K = w.shape
    expect(op, "x", x, (None, None, None))
    B, L, P = x.shape
    if x_start < 0 or x_start + C > P:
        raise ShapeError(f"{op}: x channels [{x_start}, {x_start + C}) outside its {P} columns (w has {C} channels)")
    return B, L, C, K, P


def _walk(K: int, walk: bool | None) -> bool:
    """The *_walk kernels for K ≤ 4 (every adapter); `walk` forces them (True) or the per-output kernels (False)."""
    if walk is None:
        return K <= WALK_MAX_TAPS
    if walk and K > WALK_MAX_TAPS:
        raise ShapeError(f"conv1d: the walks take at most {WALK_MAX_TAPS} taps, got {K}")
    return bool(walk)


def _segment(rt, L: int, K: int, segment: int | None) -> int:
    """Steps per walk invocation: `segment` (tests), else GPU_SEGMENT on GPUs and the whole sequence on CPU
    adapters, within llvmpipe's loop budget (a walk runs segment + K − 1 steps plus 2K tap loops)."""
    if segment is None:
        segment = min(L, SEGMENT_BUDGET - 3 * WALK_MAX_TAPS) if is_cpu(rt) else GPU_SEGMENT
    return max(1, min(int(segment), L))


def _strides(x_stride: int, C: int, x_start: int = 0, dx_stride: int | None = None, dx_col: int = 0,
             parts: list[int] | None = None) -> dict:
    """The kernels' layout uniforms; `parts`: the walks' y / dy channel widths (split1, split2 their bounds)."""
    split1 = C if parts is None else parts[0]
    split2 = C if parts is None or len(parts) < 3 else parts[0] + parts[1]
    return dict(x_stride=x_stride, x_col=x_start, dx_stride=C if dx_stride is None else dx_stride, dx_col=dx_col,
                split1=split1, split2=split2)


def _check_parts(op: str, parts: list[int] | None, C: int) -> None:
    if parts is not None and (not 1 <= len(parts) <= 3 or min(parts) < 1 or sum(parts) != C):
        raise ShapeError(f"{op}: parts {list(parts)} must be 1-3 widths adding up to the {C} channels")


def conv1d(x: Tensor, w: Tensor, b: Tensor, *, x_start: int = 0, walk: bool | None = None,
           segment: int | None = None) -> Tensor:
    """x [B, L, P] (channels in columns x_start..), w [C, K] (the [C, 1, K] weight flattened), b [C]
    -> y [B, L, C]. `walk`: see _walk; `segment`: see _segment."""
    return _forward("conv1d", x, w, b, x_start, walk, segment, silu=False)


def conv1d_silu(x: Tensor, w: Tensor, b: Tensor, *, x_start: int = 0, parts: list[int] | None = None,
                walk: bool | None = None, segment: int | None = None):
    """-> SiLU(conv1d(x, w, b)) [B, L, C] in one dispatch (the walks; the per-output path runs conv1d_forward then
    silu_forward). The backward recomputes the conv output, so it is not kept. With `parts` (1-3 channel widths
    adding up to C) the output comes as that many tensors [B, L, width], one per channel range (Mamba-2's x, B, C),
    written by the walk itself."""
    return _forward("conv1d_silu", x, w, b, x_start, walk, segment, silu=True, parts=parts)


def _walk_textures(rt, tensors: dict) -> tuple[bool, dict]:
    """The walks' TEXTURED constant and texture bindings (`x_tex`, ...): on CPU adapters, where all fit, the
    walks read these tensors through textures (kernels/texture.wgsl says why); elsewhere the bindings are unread."""
    textured = is_cpu(rt) and rt.fits_texture(*tensors.values())
    return textured, {name + "_tex": t if textured else None for name, t in tensors.items()}


def _forward(op: str, x: Tensor, w: Tensor, b: Tensor, x_start: int, walk: bool | None, segment: int | None,
             silu: bool, parts: list[int] | None = None):
    B, L, C, K, P = _dims(op, x, w, x_start)
    expect(op, "b", b, (C,))
    _check_parts(op, parts, C)
    rt = x.runtime
    if _walk(K, walk):
        outs = [rt.empty((B, L, n)) for n in (parts or [C])]
        ys = outs + [outs[0]] * (3 - len(outs))  # unused parts are never written
        seg = _segment(rt, L, K, segment)
        textured, textures = _walk_textures(rt, {"x": x})
        rt.run("conv1d_forward_walk", grid_1d(-(-L // seg) * B * C, 64),
               {"SILU": silu, "PARTS": len(outs), "TEXTURED": textured}, x=x, w=w, bias=b, y=ys[0], y1=ys[1],
               y2=ys[2], batch=B, len=L, channels=C, taps=K, block_rows=0, seg_len=seg,
               **_strides(P, C, x_start, parts=parts), **textures)
        return outs if parts is not None else outs[0]
    y = rt.empty((B, L, C))
    rt.run("conv1d_forward", grid_1d(B * L * C), x=x, w=w, bias=b, y=y, batch=B, len=L, channels=C, taps=K,
           block_rows=0, seg_len=L, **_strides(P, C, x_start))
    y = activations.silu(y) if silu else y
    if parts is None:
        return y
    return [t.reshape(B, L, -1) for t in column_split(y.reshape(B * L, C), list(parts))]


def conv1d_backward(x: Tensor, w: Tensor, dy: Tensor, dw: Tensor | None = None, db: Tensor | None = None, *,
                    x_start: int = 0, dx_out: tuple[Tensor, int] | None = None, walk: bool | None = None,
                    segment: int | None = None):
    """-> (dx, dw [C, K], db [C]); pass dw and db together to accumulate into them. dx is [B, L, C], or with
    `dx_out` = (matrix [B, L, Q], start) written into its columns [start, start + C) and that matrix returned."""
    return _backward("conv1d_backward", x, w, None, dy, None, dw, db, x_start, dx_out, walk, segment)


def conv1d_silu_backward(x: Tensor, w: Tensor, b: Tensor, dact, dact2: Tensor | None = None,
                         dw: Tensor | None = None, db: Tensor | None = None, *, x_start: int = 0,
                         dx_out: tuple[Tensor, int] | None = None, walk: bool | None = None,
                         segment: int | None = None):
    """Backward of act = conv1d_silu(x, w, b) whose gradient is dact (+ dact2 where act has a second consumer)
    -> (dx, dw, db) as conv1d_backward. dact may be a list of 1-3 tensors [B, L, width], the gradients of the channel
    ranges side by side (as conv1d_silu's `parts`), which the walk reads where they are. The walk recomputes the conv
    output and folds the add and silu_backward into its dispatch; the per-output path runs conv1d_forward,
    add_forward, silu_backward, then the conv's kernels."""
    return _backward("conv1d_silu_backward", x, w, b, dact, dact2, dw, db, x_start, dx_out, walk, segment)


def _backward(op: str, x: Tensor, w: Tensor, b: Tensor | None, dy, dy2: Tensor | None, dw: Tensor | None,
              db: Tensor | None, x_start: int, dx_out, walk: bool | None, segment: int | None):
    B, L, C, K, P = _dims(op, x, w, x_start)
    silu = b is not None
    if silu:
        expect(op, "b", b, (C,))
    dys = list(dy) if isinstance(dy, (list, tuple)) else [dy]
    parts = [t.shape[-1] for t in dys] if isinstance(dy, (list, tuple)) else None
    for i, t in enumerate(dys):
        expect(op, ("dact" if silu else "dy") + (f"[{i}]" if parts else ""), t, (B, L, None if parts else C))
    _check_parts(op, parts, C)
    if dy2 is not None:
        expect(op, "dact2", dy2, (B, L, C))
    if dw is not None or db is not None:
        expect(op, "dw", dw, (C, K))
        expect(op, "db", db, (C,))
    rt = x.runtime
    if dx_out is None:
        dx, dx_col = rt.empty((B, L, C)), 0
    else:
        dx, dx_col = dx_out
        expect(op, "dx_out", dx, (B, L, None))
        expect_columns(op, "dx_out", dx, dx_col, C)
    dims = dict(batch=B, len=L, channels=C, taps=K, block_rows=_BLOCK_ROWS)
    if _walk(K, walk):  # dx and the per-(segment, batch row) partials of dw and db in one walk
        seg = _segment(rt, L, K, segment)
        rows = -(-L // seg) * B
        dw_part, db_part = rt.empty((rows, C * K)), rt.empty((rows, C))
        srcs = dys + [dys[0]] * (3 - len(dys))  # unused parts are never read; without TWO_GRADS nor is dy_other,
        reads = dict(x=x, dy=srcs[0], dy1=srcs[1], dy2=srcs[2], dy_other=dys[0] if dy2 is None else dy2)
        textured, textures = _walk_textures(rt, reads)
        rt.run("conv1d_backward_walk", grid_1d(rows * C, 64),  # and without SILU bias
               {"SILU": silu, "TWO_GRADS": dy2 is not None, "PARTS": len(dys), "TEXTURED": textured}, w=w,
               bias=w if b is None else b, dx=dx, dw_part=dw_part, db_part=db_part, seg_len=seg, **dims,
               **_strides(P, C, x_start, dx.shape[2], dx_col, parts=parts), **reads, **textures)
    else:
        dy = dys[0] if parts is None else column_concat([t.reshape(B * L, -1) for t in dys]).reshape(B, L, C)
        dims.update(_strides(P, C, x_start, dx.shape[2], dx_col))
        if silu:
            pre = _forward(op, x, w, b, x_start, False, None, silu=False)
            dy = activations.silu_backward(pre, dy if dy2 is None else activations.add(dy, dy2))
        rt.run("conv1d_backward_input", grid_1d(B * L * C), w=w, dy=dy, dx=dx, seg_len=L, **dims)
        blocks = -(-(B * L) // _BLOCK_ROWS)
        dw_part, db_part = rt.empty((blocks, C * K)), rt.empty((blocks, C))
        rt.run("conv1d_backward_weight", (-(-C // 64), K, blocks), x=x, dy=dy, dw_part=dw_part, db_part=db_part,
               seg_len=L, **dims)
    dw = column_sums(dw_part, None if dw is None else dw.reshape(C * K)).reshape(C, K)
    return dx, dw, column_sums(db_part, db)


def conv1d_state(x: Tensor, taps: int, *, x_start: int = 0, channels: int | None = None) -> Tensor:
    """x [B, L, P] -> the decoding state [B, K − 1, C] of channels [x_start, x_start + C) (C = `channels`, default
    P − x_start): the last K − 1 inputs, oldest first (zeros before t = 0)."""
    expect("conv1d_state", "x", x, (None, None, None))
    B, L, P = x.shape
    C = P - x_start if channels is None else channels
    if x_start < 0 or C < 1 or x_start + C > P:
        raise ShapeError(f"conv1d_state: channels [{x_start}, {x_start + C}) outside x's {P} columns")
    state = x.runtime.empty((B, max(taps - 1, 1), C))
    if taps > 1:
        x.runtime.run("conv1d_state", grid_1d(B * (taps - 1) * C), x=x, conv_state=state, batch=B, len=L,
                      channels=C, taps=taps, block_rows=0, seg_len=L, **_strides(P, C, x_start))
    return state


def conv1d_step(state: Tensor, x: Tensor, w: Tensor, b: Tensor, *, x_start: int = 0, silu: bool = False,
                parts: list[int] | None = None):
    """One decoding step: x [B, P] (channels in columns x_start..), w [C, K], b [C]; state [B, K − 1, C] is
    shifted in place. -> y [B, C] (SiLU of the conv with `silu`), or with `parts` (as conv1d_silu's) one tensor
    [B, width] per channel range."""
    expect("conv1d_step", "x", x, (None, None))
    B, P = x.shape
    expect("conv1d_step", "w", w, (None, None))
    C, K = w.shape
    if x_start < 0 or x_start + C > P:
        raise ShapeError(f"conv1d_step: x channels [{x_start}, {x_start + C}) outside its {P} columns")
    expect("conv1d_step", "state", state, (B, max(K - 1, 1), C))
    expect("conv1d_step", "b", b, (C,))
    _check_parts("conv1d_step", parts, C)
    outs = [x.runtime.empty((B, n)) for n in (parts or [C])]
    ys = outs + [outs[0]] * (3 - len(outs))  # unused parts are never written
    x.runtime.run("conv1d_step", grid_1d(B * C), {"SILU": silu, "PARTS": len(outs)}, x=x, w=w, bias=b,
                  conv_state=state, y=ys[0], y1=ys[1], y2=ys[2], batch=B, len=1, channels=C, taps=K, block_rows=0,
                  seg_len=1, **_strides(P, C, x_start, parts=parts))
    return outs if parts is not None else outs[0]
