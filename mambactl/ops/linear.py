"""Linear layer y = x Wᵀ + b and its backward on the GEMMs of kernels/linear.wgsl."""

from __future__ import annotations

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect, loop_budget, segment_length
from mambactl.ops.reduce import column_sums
from mambactl.runtime.tensor import Tensor

# Tiles of the `matmul` entry point -> its pipeline constant T (rows and columns per thread; 256 threads).
# On the H200 128² won at every measured shape, x_proj's 80-column output included (64×128, 128×64 and
# BK 8 variants were never faster and were dropped); 64² is for outputs at most 64 wide.
TILES = {"64x64": 4, "128x128": 8}
_DIRECT_TILE = 64  # matmul_direct / matmul_subgroup: 64×64 outputs per workgroup of 8 invocations
_DIRECT_STORE_LOOPS = 512  # per invocation: 128 row stores of 4 columns, a loop of 4 each without VEC4
CPU_KERNELS = ("matmul_direct", "matmul_subgroup")  # no workgroup memory or barriers
_FILL_GROUPS = 512  # fewer output tiles than this: split K across workgroups (then sum the planes)
_MIN_SPLIT_K = 512  # each split's K range is at least this long
_COLUMN_SUMS_MAX = 65535 * 64  # column_sums (which adds the split planes) runs one 64-wide workgroup row


def choose_tile(M: int, N: int, K: int) -> str:
    """The `matmul` tile for an M×N output (GPU adapters)."""
    return "64x64" if min(M, N) <= 64 else "128x128"


def cpu_kernel(rt) -> str:
    """The GEMM for a CPU adapter: matmul_subgroup where subgroups have 8 lanes (it broadcasts from lanes 0-7;
    Mesa lavapipe on AVX2), else matmul_direct."""
    return "matmul_subgroup" if rt.subgroup_size == 8 else "matmul_direct"


def vec4_ok(M: int, N: int, K: int, trans_a: bool, trans_b: bool) -> bool:
    """Every row of A, B and C starts on a 16-byte boundary along its contiguous dimension (so the
    kernel's vec4 loads and stores line up): N and the contiguous dims of A and B multiples of 4."""
    return N % 4 == 0 and (M if trans_a else K) % 4 == 0 and (K if trans_b else N) % 4 == 0


def vec4_path(M: int, N: int, K: int, trans_a: bool, trans_b: bool, vec4: bool | None) -> bool:
    """The VEC4 constant (16-byte loads and stores in `matmul`, 16-byte stores in `matmul_direct`): on where
    the shape allows it unless `vec4` says otherwise; forcing it where the shape doesn't is a ShapeError."""
    can = vec4_ok(M, N, K, trans_a, trans_b)
    if vec4 and not can:
        raise ShapeError(f"matmul: vec4 loads need N and the contiguous dims of A and B to be multiples of 4 "
                         f"(M={M}, N={N}, K={K}, trans_a={trans_a}, trans_b={trans_b})")
    return can if vec4 is None else bool(vec4)


def matmul(a: Tensor, b: Tensor, *, trans_a=False, trans_b=False, bias: Tensor | None = None, out: Tensor | None = None,
           kernel: str | None = None, tile: str | None = None, vec4: bool | None = None,
           split_k: int | None = None, raster: bool | None = None) -> Tensor:
    """C[M, N] = op(A) op(B) (+ bias); A is [M, K] ([K, M] if trans_a), B is [K, N] ([N, K] if trans_b).

    With `out`, the product is added into it (gradient accumulation). The defaults pick everything by adapter
    and shape; tests and benchmarks can force each choice: `kernel` "matmul" (tiled), "matmul_direct" or
    "matmul_subgroup" (CPU adapters: `cpu_kernel`), `tile` one of TILES, `vec4=False` the scalar loads that ragged shapes need (True
    raises where the shape does not allow vec4), `split_k` the number of K slices (default: enough to fill
    the GPU when the output has few tiles and K is long), `raster` whether workgroup x walks row tiles
    (default: x walks whichever of rows and columns has fewer tiles)."""
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
    cpu = rt.info.type == "CPU"
    entry = kernel or (cpu_kernel(rt) if cpu else "matmul")
    consts = {"TRANS_A": trans_a, "TRANS_B": trans_b, "HAS_BIAS": bias is not None}
    if entry == "matmul":
        tile = tile or choose_tile(M, N, K)
        if tile not in TILES:
            raise ShapeError(f"matmul: unknown tile {tile!r}; one of {sorted(TILES)}")
        t = TILES[tile]
        bm = bn = 16 * t
        if raster is None:
            raster = -(-M // bm) < -(-N // bn)
        consts.update(VEC4=vec4_path(M, N, K, trans_a, trans_b, vec4), T=t, RASTER=raster)
    elif entry in CPU_KERNELS:
        bm = bn = _DIRECT_TILE
        consts["VEC4"] = vec4_path(M, N, K, trans_a, trans_b, vec4)  # its stores (its loads are scalar)
    else:
        raise ShapeError(f"matmul: unknown kernel {entry!r}; 'matmul', 'matmul_direct' or 'matmul_subgroup'")
    groups = (-(-N // bn), -(-M // bm))
    if entry == "matmul" and raster:
        groups = groups[::-1]
    if split_k is None:
        tiles = groups[0] * groups[1]
        split_k = 1 if bias is not None or cpu else max(1, min(_FILL_GROUPS // tiles, K // _MIN_SPLIT_K))
        if M * N > _COLUMN_SUMS_MAX or split_k * M * N * 4 > rt.max_binding:
            split_k = 1
        if entry in CPU_KERNELS:  # one loop iteration per k: on llvmpipe a K range must fit its loop budget
            k_range = segment_length(rt, "matmul", (M, K, N), K, per_step=1, fixed=_DIRECT_STORE_LOOPS, multiple=16)
            split_k = max(split_k, -(-K // k_range))
            if split_k > 1 and (bias is not None or M * N > _COLUMN_SUMS_MAX or split_k * M * N * 4 > rt.max_binding):
                loop_budget(rt, "matmul", (M, K, N), K)  # K can't be split here: refuse rather than cut it short
    k_split = -(-(-(-K // split_k)) // 16) * 16  # a multiple of every kernel's K tile
    splits = max(1, -(-K // k_split))
    if splits == 1:
        consts["ACCUMULATE"] = out is not None
        if out is None:
            out = rt.empty((M, N))
        rt.run(entry, groups, consts, a=a, b=b, bias=bias if bias is not None else a, c=out, m=M, n=N, k=K,
               k_split=K)
        return out
    if bias is not None:
        raise ShapeError("matmul: split-K with a bias is not supported")
    planes = rt.empty((splits, M, N))
    consts["ACCUMULATE"] = False
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
