"""Column slice / scatter / concat of row-major matrices (kernels/slice.wgsl). Up to three consecutive column
ranges move in one dispatch (`column_split`, `column_concat`). `row_block`: consecutive rows, as a view where the
device can bind one there."""

from __future__ import annotations

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect, grid_1d, rows_kernel
from mambactl.ops.fill import zeros
from mambactl.runtime.tensor import Tensor

PARTS_PER_DISPATCH = 3  # the kernels' dst/dst1/dst2 and src/src1/src2 bindings


def _launch(rt, entry: str, M: int, widths: list[int], rows_path: bool | None, aligned: bool, sources: list[Tensor]):
    """-> (entry point, grid, its bindings' names: "rows", "vec4" or ""): per row on CPU adapters, else per element,
    four at a time where every width and offset is a multiple of 4 (`aligned`)."""
    if rows_kernel(rt, sum(widths), rows_path, sources):  # a row's columns in a loop, the sources as textures
        return entry + "_rows", grid_1d(M, 64), "rows"
    if aligned and all(w % 4 == 0 for w in widths):
        return entry + "_vec4", grid_1d(M * sum(widths) // 4), "vec4"
    return entry, grid_1d(M * sum(widths)), ""


_NAMES = {"vec4": {"src": "src4", "src1": "src4_1", "src2": "src4_2", "dst": "dst4", "dst1": "dst4_1", "dst2": "dst4_2"},
          "rows": {"src": "src_tex", "src1": "src1_tex", "src2": "src2_tex"}}


def _bind(names: tuple[str, ...], kind: str, tensors: list[Tensor]) -> dict:
    """The kernels' buffers by name (the vec4 entry points' own bindings, the rows ones' textures)."""
    rename = _NAMES.get(kind, {})
    return {rename.get(n, n): t for n, t in zip(names, tensors)}


def _widths(parts: list[int]) -> dict:
    w = list(parts) + [0] * (PARTS_PER_DISPATCH - len(parts))
    return dict(width=w[0], width1=w[1], width2=w[2])


def column_split(x: Tensor, widths: list[int], start: int = 0, rows_path: bool | None = None) -> list[Tensor]:
    """x [M, P] -> [x[:, start : start + w0], the next w1 columns, ...] as new [M, w_k] tensors, three per pass.
    `rows_path`: see checks.rows_kernel."""
    expect("column_split", "x", x, (None, None))
    M, P = x.shape
    if not widths or min(widths) < 1 or start < 0 or start + sum(widths) > P:
        raise ShapeError(f"column_split: widths {list(widths)} from column {start} outside a matrix of {P} columns")
    outs = [x.runtime.empty((M, w)) for w in widths]
    col = start
    for k in range(0, len(widths), PARTS_PER_DISPATCH):
        part, dsts = widths[k:k + PARTS_PER_DISPATCH], outs[k:k + PARTS_PER_DISPATCH]
        dsts = dsts + [dsts[0]] * (PARTS_PER_DISPATCH - len(dsts))  # unused parts (width 0) are never written
        entry, grid, kind = _launch(x.runtime, "column_slice", M, part, rows_path, P % 4 == 0 and col % 4 == 0, [x])
        x.runtime.run(entry, grid, {"PARTS": len(part)}, **_bind(("src", "dst", "dst1", "dst2"), kind, [x] + dsts),
                      rows=M, src_cols=P, dst_cols=part[0], start=col, **_widths(part))
        col += sum(part)
    return outs


def row_block(x: Tensor, start: int, rows: int) -> Tensor:
    """x[start : start + rows] along the first dimension (a weight's rows, a bias's entries): a view of x where its
    byte offset is a multiple of the device's storage offset alignment (nothing is copied), else a copy. Read it
    only: a write to the copy would not reach x."""
    expect("row_block", "x", x)
    n = x.shape[0]
    if start < 0 or rows < 1 or start + rows > n:
        raise ShapeError(f"row_block: rows [{start}, {start + rows}) outside a tensor of {n} rows")
    per_row = x.size // n
    view = x.view(start * per_row, (rows,) + x.shape[1:])
    rt = x.runtime
    if view.offset % int(rt.limits["min-storage-buffer-offset-alignment"]) == 0:
        return view
    out = rt.empty(view.shape)
    rt.copy(view, out)  # buffer copies need 4-byte offsets only
    return out


def column_slice(x: Tensor, start: int, width: int, rows_path: bool | None = None) -> Tensor:
    """x [M, P] -> x[:, start:start+width] as a new [M, width] tensor. `rows_path`: see checks.rows_kernel."""
    expect("column_slice", "x", x, (None, None))
    P = x.shape[1]
    if start < 0 or width < 1 or start + width > P:
        raise ShapeError(f"column_slice: columns [{start}, {start + width}) outside a matrix of {P} columns")
    return column_split(x, [width], start, rows_path)[0]


def column_concat(parts: list[Tensor], out: Tensor | None = None, start: int = 0, accumulate: bool = False,
                  rows_path: bool | None = None) -> Tensor:
    """[M, P_i]... side by side into columns start.. of `out` (a new [M, Σ P_i] matrix without it; with
    `accumulate` added into it), three parts per pass. Returns out. `rows_path`: see checks.rows_kernel."""
    for i, t in enumerate(parts):
        expect("column_concat", f"parts[{i}]", t, (parts[0].shape[0] if i else None, None))
    M, total = parts[0].shape[0], sum(t.shape[1] for t in parts)
    if out is None:
        out = parts[0].runtime.empty((M, total))
    expect("column_concat", "out", out, (M, None))
    if start < 0 or start + total > out.shape[1]:
        raise ShapeError(f"column_concat: columns [{start}, {start + total}) outside a matrix of {out.shape[1]} columns")
    col = start
    for k in range(0, len(parts), PARTS_PER_DISPATCH):
        group = parts[k:k + PARTS_PER_DISPATCH]
        srcs = group + [group[0]] * (PARTS_PER_DISPATCH - len(group))  # unused parts (width 0) are never read
        widths = [t.shape[1] for t in group]
        entry, grid, kind = _launch(out.runtime, "column_scatter", M, widths, rows_path,
                                    out.shape[1] % 4 == 0 and col % 4 == 0, group)
        out.runtime.run(entry, grid, {"ACCUMULATE": accumulate, "PARTS": len(group)},
                        **_bind(("src", "src1", "src2", "dst"), kind, srcs + [out]), rows=M, src_cols=widths[0],
                        dst_cols=out.shape[1], start=col, **_widths(widths))
        col += sum(widths)
    return out


def column_scatter(src: Tensor, dst: Tensor, start: int, accumulate: bool = False,
                   rows_path: bool | None = None) -> Tensor:
    """dst[:, start:start+W] = src [M, W] (or += with accumulate). Returns dst. `rows_path`: see checks.rows_kernel."""
    expect("column_scatter", "src", src, (None, None))
    M, W = src.shape
    expect("column_scatter", "dst", dst, (M, None))
    if start < 0 or start + W > dst.shape[1]:
        raise ShapeError(f"column_scatter: columns [{start}, {start + W}) outside a matrix of {dst.shape[1]} columns")
    return column_concat([src], dst, start, accumulate, rows_path)


def column_slice_backward(dy: Tensor, start: int, total_width: int, dx: Tensor | None = None,
                          rows_path: bool | None = None) -> Tensor:
    """Gradient of column_slice: dy [M, W] lands in columns [start, start+W) of dx [M, total_width].
    Without `dx` a zeroed matrix is made; with it, dy is added in place."""
    if dx is None:
        dx = zeros(dy.runtime, (dy.shape[0], total_width))
    return column_scatter(dy, dx, start, accumulate=True, rows_path=rows_path)
