"""Linear layer y = x Wᵀ + b and its backward on the GEMMs of kernels/linear.wgsl and kernels/linear_f16.wgsl.

Precision: "fp32" (the default) or "f16" — f16 operands in workgroup memory and vec4<f16> products, short f16
partial sums flushed into f32 accumulators every FLUSH k steps, each operand scaled by a power of two from its
max |x| (computed on the GPU by `operand_amax`) so gradients (~1e-6..1e-9, below f16's normal range) keep their
digits and no partial sum can overflow. Tensors in memory, master weights and the optimizer stay fp32. A call
takes `precision=`, else the runtime's `matmul_precision` (the training loop sets it from
`[train] matmul_precision`), so the models call the same ops in both modes.

Large forwards on GPUs (`transposes_weight`) multiply by a transposed copy of W made in the call, which the tiled
kernel reads faster than W itself (TRANSPOSE_MIN_ROWS says why).
"""

from __future__ import annotations

import math

import numpy as np

from mambactl.errors import ShapeError
from mambactl.ops.checks import cpu_subgroups, expect, grid_1d, is_cpu, is_llvmpipe, loop_budget, segment_length
from mambactl.ops.reduce import column_sums
from mambactl.ops.transpose import transpose
from mambactl.runtime.tensor import Tensor

# Tiles of the `matmul` entry point -> its pipeline constant T (rows and columns per thread; 256 threads).
# On the H200 128² won at every measured shape, x_proj's 80-column output included (64×128, 128×64 and
# BK 8 variants were never faster and were dropped); 64² is for outputs at most 64 wide.
TILES = {"64x64": 4, "128x128": 8}
MATVEC_ROWS = 4  # `matvec` (C = A Bᵀ, K a multiple of 4) takes GPU products of at most this many rows of A
_MATVEC_COLS = 8  # columns of C per matvec workgroup (MV_COLS there)
_DIRECT_TILE = 64  # matmul_direct / matmul_subgroup: 64×64 outputs per workgroup of 8 invocations (subgroup: N ≥ 64)
_DIRECT_STORE_LOOPS = 512  # per invocation: 128 row stores of 4 columns, a loop of 4 each without VEC4
CPU_KERNELS = ("matmul_direct", "matmul_subgroup")  # no workgroup memory or barriers
# Fewer output tiles than _FILL_GROUPS: split K across workgroups (then sum the planes). 1024 (was 512): on the
# H200 (bench/gemm.py --gpu-times, kernel alone, 2026-12-01 23:17-23:55) in_proj's dW (144 tiles, K 8192) ran
# 22.9/31.1/35.1/37.3/39.9 TFLOP/s at 1/2/3/4/6 K slices (and, in a run of a slower kernel variant, 27.1/30.8/31.5/
# 32.1/31.0 at 3/6/8/10/12); out_proj's dW (72 tiles) 33.1/29.6/33.2/37.7 at 3/4/6/7 and level from 7 to 16.
# At 1024 (2026-12-02 00:2x, same run): in_proj dW 38.7 at 7 slices against 33.5 at 3 (with the planes' sum 32.4
# against 28.8), out_proj dW 36.1 at 14 against 36.4 at 7.
# 1300 (was 1024) and no split above 256 tiles (was any output of ≤ 512 tiles, which 1024 // tiles split): a
# Mamba-2 130m step on the H200 213.8/213.6 -> 212.4/212.4 ms streamed with 1300 alone, 212.3/212.7 with both
# (2026-12-02 22:40, two rounds alternating; Mamba-1 196.6 -> 196.4, Mamba-3 243.8 -> 240.6). 1300 splits in_proj's
# dW (162 tiles) 8 ways and out_proj's (72) 16: 9.8 and 8.7 waves of the H200's 132 multiprocessors at one 128²
# workgroup each, against 7.4 and 7.9 at 6 and 14 (wave tails are this value's whole effect there). The 384-tile
# outputs (out_proj forward, in_proj dX, the tied head's dX: ~3 waves already) lose nothing unsplit, and skip
# writing and summing the planes.
_FILL_GROUPS = 1300
_MIN_SPLIT_K = 512  # each split's K range is at least this long
_SPLIT_MAX_TILES = 256  # outputs of more tiles than this are never split
_COLUMN_SUMS_MAX = 65535 * 64  # column_sums (which adds the split planes) runs one 64-wide workgroup row
# `linear` multiplies by Wᵀ (transposed per call, kernels/transpose.wgsl) from this many rows on. With both operands
# K-contiguous the tiled kernel stages both by transposed stores and runs ~20% slower than with W's transpose
# (H200, kernel alone: fwd 33.2 against dX's 41.5 TFLOP/s at 4096³). The transpose moves 8·N·K bytes, which by
# that ~20% on 2·M·N·K FLOPs (at ~35 TFLOP/s and ~3 TB/s) pays for itself from a few hundred rows on: an estimate,
# with 1024 leaving a margin (the 8192-row products measured; decoding, M = batch, keeps W as it is).
TRANSPOSE_MIN_ROWS = 1024
PRECISIONS = ("fp32", "f16")
# matmul_f16's defaults, from bench/gemm.py on the H200 (amax passes included; at a7ea729, 2026-12-01 18:28):
# 32-k shared tiles with a flush at each tile's end beat 16-k tiles flushed every 16 at in_proj (34.0/35.0/31.0 against
# 30.0/34.7/29.4 TFLOP/s fwd/dX/dW), out_proj's forward and the tied head, and the training step (311 against
# 315 ms); flushing every 32 k steps inside 16-k tiles (a branch in the K loop) and every 8 were slower.
# The worst-case error (f16_error_bound) grows with FLUSH, ≈ (FLUSH + 3)·2^-10·Σ|a||b|: 3.4% at 32 (1.8% at 16);
# chosen because a bound is what the tests can check without fitting, while actual errors grow like √FLUSH
# (1-6% of the bound in tests/test_ops_linear_f16.py) and f16 training tracks fp32 (tests/test_train.py).
FLUSH = 32  # k steps per f16 partial sum
SUBTILES = 2  # 16-k slices per shared tile and barrier (1 or 2)
_F16_MAX_SUM_EXP = 15  # a partial sum is kept below 2^15 (f16's largest finite value is 65504 < 2^16)
_AMAX_VEC4S = 16  # operand_amax: vec4s per thread (AMAX_VEC4S in linear_f16.wgsl)
F16_ROUNDING = 2.0 ** -10  # WGSL lets an f16 result be either neighbour of the exact value: 1 ulp, 2^-10 relative
F16_SUBNORMAL = 2.0 ** -24  # the spacing of f16's subnormals: the absolute error of a result that underflows
F32_ROUNDING = 2.0 ** -23


def operand_exponent(flush: int) -> int:
    """OPERAND_EXP of matmul_f16: staged operands are scaled below 2^e, so a partial sum of `flush` products
    stays below flush · 2^(2e); the largest e with that ≤ 2^15."""
    return (_F16_MAX_SUM_EXP - int(math.log2(flush))) // 2


def operand_scale_exponent(amax: float, flush: int = FLUSH) -> int:
    """log2 of the scale matmul_f16 gives an operand whose max |x| is `amax` (scale_exp in linear_f16.wgsl)."""
    if amax == 0 or not math.isfinite(amax):
        return 0
    biased = int(np.float32(amax).view(np.uint32)) >> 23
    return min(max(operand_exponent(flush) - (biased - 126), -126), 126)


def f16_error_bound(a, b, flush: int = FLUSH):
    """Elementwise bound on |matmul_f16(a, b) - a·b| (float64 a [M, K], b [K, N], the values given to the
    kernel), derived from the kernel's arithmetic in units scaled by s = 2^(scale exponents), ε = F16_ROUNDING,
    η = F16_SUBNORMAL, with S = Σ_k |a_k||b_k| (scaled):
      staging  a' = s_a·a (1 + δ) + ξ, |δ| ≤ ε, |ξ| ≤ η (likewise b'):
               |a'b' - s_a s_b ab| ≤ (2ε + ε²)|s_a s_b ab| + η(|a'| + |s_b b|); over k:
               (2ε + ε²) S + η (Σ|a'| + Σ|s_b b|) ≤ (2ε + ε²) S + η((1+ε)(A + B) + Kη)
      f16 sums each fma rounds its product and its sum: a product in a partial sum of ≤ F terms is rounded ≤ F + 1
               times, relative ε each, plus η per rounding: γ_{F+1} Σ|a'b'| + 2Kη, γ_n = nε / (1 - nε)
      f32 sums ⌈K/F⌉ flushes plus the store: γ32_{⌈K/F⌉+1} Σ|partials|; the final scale is exact (a power
               of two).
    A = Σ_k |s_a a_k| (row sums), B = Σ_k |s_b b_k| (column sums). Returned in the unscaled units of a·b."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    K = a.shape[1]
    ea = operand_scale_exponent(float(np.abs(a).max()), flush)
    eb = operand_scale_exponent(float(np.abs(b).max()), flush)
    sa, sb = 2.0 ** ea, 2.0 ** eb
    eps, eta = F16_ROUNDING, F16_SUBNORMAL

    def gamma(n, u):
        return n * u / (1 - n * u)

    S = (np.abs(a) * sa) @ (np.abs(b) * sb)
    A = (np.abs(a) * sa).sum(axis=1, keepdims=True)
    B = (np.abs(b) * sb).sum(axis=0, keepdims=True)
    staging = (2 * eps + eps * eps) * S + eta * ((1 + eps) * (A + B) + K * eta)
    products = S + staging  # ≥ Σ|a'b'|
    f16_sums = gamma(flush + 1, eps) * products + 2 * K * eta
    f32_sums = gamma(-(-K // flush) + 1, F32_ROUNDING) * (products + f16_sums)
    return (staging + f16_sums + f32_sums) / (sa * sb)


def operand_amax(x: Tensor) -> Tensor:
    """[1] uint32: the bits of max |x| (the float; NaN above inf), computed on the GPU for matmul_f16's scales."""
    expect("operand_amax", "x", x)
    rt = x.runtime
    out = rt.empty((1,), np.uint32)
    rt.run("fill", (1,), dst=out, n=1, value=0.0)  # 0.0's bits are 0: the identity of the max
    groups = grid_1d(-(-x.size // (4 * _AMAX_VEC4S)))
    rt.run("operand_amax", groups, a=x, amax_out=out, count=x.size, groups_x=groups[0])
    return out


def choose_tile(M: int, N: int, K: int) -> str:
    """The `matmul` tile for an M×N output (GPU adapters)."""
    return "64x64" if min(M, N) <= 64 else "128x128"


def cpu_kernel(rt, a: Tensor, b: Tensor) -> str:
    """The GEMM for a CPU adapter: matmul_subgroup where subgroups have 8 lanes (it broadcasts from lanes 0-7;
    Mesa lavapipe on AVX2) and both operands fit its textures, else matmul_direct."""
    return "matmul_subgroup" if cpu_subgroups(rt) and rt.fits_texture(a, b) else "matmul_direct"


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
           split_k: int | None = None, raster: bool | None = None, precision: str | None = None,
           flush: int | None = None, subtiles: int | None = None, amax: tuple | None = None) -> Tensor:
    """C[M, N] = op(A) op(B) (+ bias); A is [M, K] ([K, M] if trans_a), B is [K, N] ([N, K] if trans_b).

    With `out`, the product is added into it (gradient accumulation). The defaults pick everything by adapter
    and shape; tests and benchmarks can force each choice: `kernel` "matmul" (tiled), "matvec" (GPUs' pick for
    at most MATVEC_ROWS rows times Bᵀ), "matmul_direct" or "matmul_subgroup" (CPU adapters: `cpu_kernel`), `tile` one of TILES, `vec4=False` the scalar loads that
    ragged shapes need (True raises where the shape does not allow vec4), `split_k` the number of K slices
    (default: enough to fill the GPU when the output has few tiles and K is long), `raster` whether workgroup x
    walks row tiles (default: x walks whichever of rows and columns has fewer tiles).

    `precision` "fp32" or "f16" (default: the runtime's `matmul_precision`); "f16" runs matmul_f16 (the tiled
    kernel on every adapter), with `flush` k steps per f16 partial sum (default FLUSH), `subtiles` 16-k slices
    per shared tile (default SUBTILES), and `amax` an optional
    (operand_amax(a), operand_amax(b)) pair already computed (linear_backward shares dy's)."""
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
    cpu = is_cpu(rt)
    precision = precision or rt.matmul_precision
    if precision not in PRECISIONS:
        raise ShapeError(f"matmul: unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")
    half = precision == "f16"
    if half and kernel not in (None, "matmul_f16"):
        raise ShapeError(f"matmul: precision f16 runs matmul_f16, not {kernel!r}")
    fits_matvec = (trans_b and not trans_a and M <= MATVEC_ROWS and K % 4 == 0 and vec4 is not False
                   and -(-N // _MATVEC_COLS) <= rt.max_groups)
    if kernel == "matvec" and not fits_matvec:
        raise ShapeError(f"matmul: matvec needs A [M ≤ {MATVEC_ROWS}, K] times Bᵀ with K a multiple of 4 (M={M}, "
                         f"N={N}, K={K}, trans_a={trans_a}, trans_b={trans_b})")
    tiled_asked = tile is not None or split_k is not None or raster is not None  # choices of the tiled kernel
    entry = kernel or ("matmul_f16" if half else cpu_kernel(rt, a, b) if cpu else
                       "matvec" if fits_matvec and not tiled_asked else "matmul")
    if entry == "matvec":
        c = rt.empty((M, N)) if out is None else out
        rt.run("matvec", (-(-N // _MATVEC_COLS),), {"HAS_BIAS": bias is not None, "ACCUMULATE": out is not None},
               a=a, b=b, bias=bias if bias is not None else a, c=c, m=M, n=N, k=K, k_split=K)
        return c
    consts = {"TRANS_A": trans_a, "TRANS_B": trans_b, "HAS_BIAS": bias is not None}
    if half:
        flush = FLUSH if flush is None else int(flush)
        if flush < 8 or flush & (flush - 1):
            raise ShapeError(f"matmul: flush must be a power of two >= 8, got {flush}")
        subtiles = SUBTILES if subtiles is None else int(subtiles)
        if subtiles not in (1, 2):
            raise ShapeError(f"matmul: subtiles must be 1 or 2, got {subtiles}")
        consts.update(FLUSH=flush, OPERAND_EXP=operand_exponent(flush), SUBTILES=subtiles)
        amax_a, amax_b = amax if amax is not None else (operand_amax(a), operand_amax(b))
    if entry in ("matmul", "matmul_f16"):
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
        consts["VEC4"] = vec4_path(M, N, K, trans_a, trans_b, vec4)  # stores (matmul_subgroup: and texel loads)
        if entry == "matmul_subgroup":  # a narrow N takes a tile of the fewest 4-column groups that cover it
            consts["COL_GROUPS"] = min(_DIRECT_TILE // 4, -(-N // 4))
            bn = 4 * consts["COL_GROUPS"]
    else:
        raise ShapeError(f"matmul: unknown kernel {entry!r}; 'matmul', 'matmul_f16', 'matvec', 'matmul_direct' or "
                         "'matmul_subgroup'")
    groups = (-(-N // bn), -(-M // bm))
    if entry not in CPU_KERNELS and raster:
        groups = groups[::-1]
    if split_k is None:
        tiles = groups[0] * groups[1]
        split_k = 1 if bias is not None or cpu or tiles > _SPLIT_MAX_TILES else max(
            1, min(_FILL_GROUPS // tiles, K // _MIN_SPLIT_K))
        if M * N > _COLUMN_SUMS_MAX or split_k * M * N * 4 > rt.max_binding:
            split_k = 1
        if entry in CPU_KERNELS:  # one loop iteration per k: on llvmpipe a K range must fit its loop budget
            k_range = segment_length(rt, "matmul", (M, K, N), K, per_step=1, fixed=_DIRECT_STORE_LOOPS, multiple=16)
            split_k = max(split_k, -(-K // k_range))
            if split_k > 1 and (bias is not None or M * N > _COLUMN_SUMS_MAX or split_k * M * N * 4 > rt.max_binding):
                loop_budget(rt, "matmul", (M, K, N), K)  # K can't be split here: refuse rather than cut it short
    k_split = -(-(-(-K // split_k)) // 16) * 16  # a multiple of every kernel's K tile
    splits = max(1, -(-K // k_split))
    if entry not in CPU_KERNELS and is_llvmpipe(rt):
        # the tiled kernels: one loop step per K tile, plus without VEC4 a 4-step loop per staged vec4 (2·T/4 per
        # 16 k) and per stored row of 4 (16 per 4×4 block)
        t, sub = consts["T"], consts.get("SUBTILES", 1)
        scalar = not consts["VEC4"]
        loops = -(-min(k_split, K) // (16 * sub)) * (1 + scalar * 2 * t * sub) + scalar * 16 * (t // 4) ** 2
        loop_budget(rt, "matmul", (M, K, N), loops)
    scales = {"a_amax": amax_a, "b_amax": amax_b} if half else {}
    if splits == 1:
        consts["ACCUMULATE"] = out is not None
        if out is None:
            out = rt.empty((M, N))
        rt.run(entry, groups, consts, a=a, b=b, a_tex=a, b_tex=b, bias=bias if bias is not None else a, c=out, m=M,
               n=N, k=K, k_split=K, **scales)
        return out
    if bias is not None:
        raise ShapeError("matmul: split-K with a bias is not supported")
    planes = rt.empty((splits, M, N))
    consts["ACCUMULATE"] = False
    rt.run(entry, groups + (splits,), consts, a=a, b=b, a_tex=a, b_tex=b, bias=a, c=planes, m=M, n=N, k=K,
           k_split=k_split, **scales)
    summed = column_sums(planes.reshape(splits, M * N), None if out is None else out.reshape(M * N))
    return out if out is not None else summed.reshape(M, N)


def transposes_weight(rt, rows: int) -> bool:
    """Whether `linear` of `rows` rows on runtime `rt` multiplies by a transposed copy of the weight: on GPUs
    (not CPU adapters) for at least TRANSPOSE_MIN_ROWS rows."""
    return not is_cpu(rt) and rows >= TRANSPOSE_MIN_ROWS


def linear(x: Tensor, w: Tensor, b: Tensor | None = None, *, transpose_weight: bool | None = None) -> Tensor:
    """x [M, K], w [N, K], b [N] -> [M, N]. `transpose_weight` (default `transposes_weight`) runs the product on
    a transposed copy wᵀ [K, N] made for this call instead of on w: the same sums in the same order."""
    expect("linear", "x", x, (None, None))
    expect("linear", "w", w, (None, x.shape[1]))
    if transpose_weight is None:
        transpose_weight = transposes_weight(x.runtime, x.shape[0])
    if transpose_weight:
        return matmul(x, transpose(w), bias=b)
    return matmul(x, w, trans_b=True, bias=b)


def bias_backward(dy: Tensor, out: Tensor | None = None) -> Tensor:
    """db [N] (+)= Σ_m dy[m, :]."""
    expect("bias_backward", "dy", dy, (None, None))
    return column_sums(dy, out)


def linear_backward(x: Tensor, w: Tensor, dy: Tensor, *, dw: Tensor | None = None, db: Tensor | None = None,
                    need_dx: bool = True, has_bias: bool = False):
    """-> (dx [M, K] = dy w, dw [N, K] (+)= dyᵀ x, db [N] (+)= Σ dy or None). Pass dw/db to accumulate.
    In f16 precision dy's max |dy| is computed once for both products."""
    expect("linear_backward", "dy", dy, (x.shape[0], w.shape[0]))
    half = dy.runtime.matmul_precision == "f16"
    amax_dy = operand_amax(dy) if half else None
    dx = matmul(dy, w, amax=(amax_dy, operand_amax(w)) if half else None) if need_dx else None
    dw = matmul(dy, x, trans_a=True, out=dw, amax=(amax_dy, operand_amax(x)) if half else None)
    dbias = bias_backward(dy, db) if (has_bias or db is not None) else None
    return dx, dw, dbias
