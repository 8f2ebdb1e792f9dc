"""Every core op on the GPU against its float64 reference, at awkward shapes, with poisoned outputs.

The reference runs on the float32-rounded inputs, so the comparison measures the kernel, not input
rounding. Element-wise ops must agree to 1e-5, reductions and GEMMs to 1e-4 (relative, ‖gpu−ref‖/‖ref‖).
"""


import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.ops import activations, checks, conv1d, cross_entropy, embedding, fill, linear, reduce, rmsnorm, slice, transpose
from mambactl.reference import activations as ref_act
from mambactl.reference import conv1d as ref_conv
from mambactl.reference import cross_entropy as ref_ce
from mambactl.reference import embedding as ref_emb
from mambactl.reference import linear as ref_linear
from mambactl.reference import reduce as ref_reduce
from mambactl.reference import rmsnorm as ref_norm
from mambactl.reference import slice as ref_slice
from mambactl.reference import transpose as ref_transpose

ELEMENTWISE_TOL = 1e-5
REDUCTION_TOL = 1e-4


def rel(gpu, ref):
    gpu, ref = np.asarray(gpu, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(gpu)), "unwritten (NaN-poisoned) or non-finite elements in the GPU output"
    denom = np.linalg.norm(ref)
    assert denom > 0, "the reference is all zeros: the test would prove nothing"
    return np.linalg.norm(gpu - ref) / denom


def f32(rng, *shape, scale=1.0):
    """Random float32 data and its exact float64 value."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return x, x.astype(np.float64)


UNARY = ["silu", "softplus", "sigmoid", "exp"]


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("n", [1, 3, 17, 65, 130, 70_000])
def test_unary_forward_backward(rt, rng, name, n):
    x32, x = f32(rng, n, scale=4.0)
    if name == "softplus" and n >= 17:  # both sides of PyTorch's threshold 20
        x32[:6] = [19.5, 20.0, 20.5, 35.0, -30.0, 0.0]
        x = x32.astype(np.float64)
    dy32, dy = f32(rng, n)
    gx = rt.from_numpy(x32)
    y = getattr(activations, name)(gx).numpy()
    dx = getattr(activations, name + "_backward")(gx, rt.from_numpy(dy32)).numpy()
    assert rel(y, getattr(ref_act, name)(x)) < ELEMENTWISE_TOL
    assert rel(dx, getattr(ref_act, name + "_backward")(x, dy)) < ELEMENTWISE_TOL


@pytest.mark.parametrize("name", ["silu", "sigmoid"])
def test_gate_derivatives_keep_their_digits_in_the_tails(rt, name):
    """σ'(x) = σ(x)σ(−x): forming 1 − σ(x) by subtraction loses digits for large x (seen on an H200 at
    x = 8.8, error 3e-4); every element must match to float32 precision, not just the norm."""
    x = np.concatenate([np.linspace(5, 16, 23), -np.linspace(5, 16, 23)]).astype(np.float32)
    dy = np.ones_like(x)
    got = getattr(activations, name + "_backward")(rt.from_numpy(x), rt.from_numpy(dy)).numpy()
    want = getattr(ref_act, name + "_backward")(x.astype(np.float64), dy.astype(np.float64))
    assert np.max(np.abs(got - want) / np.abs(want)) < 1e-5


def test_softplus_keeps_its_digits_for_negative_inputs(rt):
    """softplus(x) = log(1 + e^x) for x < 0: WGSL's log may be off by 2^-21 absolute near 1 (llvmpipe is), which
    was 1e-4 relative at x = −8; every element must match to float32 precision."""
    x = np.concatenate([-np.linspace(0.5, 30, 60), np.linspace(-0.5, 0.5, 11)]).astype(np.float32)
    got = activations.softplus(rt.from_numpy(x)).numpy()
    want = ref_act.softplus(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 2e-6


@pytest.mark.parametrize("n", [1, 17, 130])
def test_add_mul(rt, rng, n):
    (a32, a), (b32, b), (dy32, dy) = f32(rng, n), f32(rng, n), f32(rng, n)
    ga, gb = rt.from_numpy(a32), rt.from_numpy(b32)
    assert rel(activations.add(ga, gb).numpy(), a + b) < ELEMENTWISE_TOL
    assert rel(activations.mul(ga, gb).numpy(), a * b) < ELEMENTWISE_TOL
    da, db = activations.mul_backward(ga, gb, rt.from_numpy(dy32))
    rda, rdb = ref_act.mul_backward(a, b, dy)
    assert rel(da.numpy(), rda) < ELEMENTWISE_TOL and rel(db.numpy(), rdb) < ELEMENTWISE_TOL


@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (3, 17, 5), (17, 3, 65), (65, 130, 33), (130, 64, 200)])
def test_linear_forward_backward(rt, rng, M, K, N):
    (x32, x), (w32, w), (b32, b), (dy32, dy) = f32(rng, M, K), f32(rng, N, K), f32(rng, N), f32(rng, M, N)
    gx, gw = rt.from_numpy(x32), rt.from_numpy(w32)
    y = linear.linear(gx, gw, rt.from_numpy(b32)).numpy()
    assert rel(y, ref_linear.linear(x, w, b)) < REDUCTION_TOL
    dx, dw, db = linear.linear_backward(gx, gw, rt.from_numpy(dy32), has_bias=True)
    rdx, rdw, rdb = ref_linear.linear_backward(x, w, dy)
    assert rel(dx.numpy(), rdx) < REDUCTION_TOL
    assert rel(dw.numpy(), rdw) < REDUCTION_TOL
    assert rel(db.numpy(), rdb) < REDUCTION_TOL


@pytest.mark.parametrize("R,C", [(1, 1), (1, 37), (37, 1), (32, 32), (33, 65), (100, 7), (64, 96)])
def test_transpose(rt, rng, R, C):
    """Bit-exact, every element written (the output starts poisoned), edge tiles in both dimensions."""
    x32, x = f32(rng, R, C)
    got = transpose.transpose(rt.from_numpy(x32)).numpy()
    assert got.shape == (C, R)
    assert np.array_equal(got, ref_transpose.transpose(x))


@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (3, 17, 5), (65, 130, 33), (130, 64, 200)])
def test_linear_on_transposed_weight(rt, rng, M, K, N):
    """The forward that large GPU products take (a per-call copy of wᵀ), forced here at small shapes."""
    (x32, x), (w32, w), (b32, b) = f32(rng, M, K), f32(rng, N, K), f32(rng, N)
    gx, gw, gb = rt.from_numpy(x32), rt.from_numpy(w32), rt.from_numpy(b32)
    assert rel(linear.linear(gx, gw, gb, transpose_weight=True).numpy(), ref_linear.linear(x, w, b)) < REDUCTION_TOL
    assert rel(linear.linear(gx, gw, transpose_weight=True).numpy(), ref_linear.linear(x, w)) < REDUCTION_TOL
    assert np.array_equal(gw.numpy(), w32)  # the weight itself is left as it was


def test_transposes_weight_rule(rt):
    rows = linear.TRANSPOSE_MIN_ROWS
    assert linear.transposes_weight(rt, rows) == (not checks.is_cpu(rt))
    assert not linear.transposes_weight(rt, rows - 1)


# (kernel, tile, vec4): matmul_direct and matmul_subgroup with their default stores (vec4 where N allows) and with
# scalar stores forced, and every tile of the tiled kernel with the default load path (vec4 where the shape allows it, scalar
# at ragged shapes) and with the scalar loads forced.
MATMUL_KERNELS = [(k, None, v) for k in linear.CPU_KERNELS for v in (None, False)] + [("matmul", tile, None) for tile in sorted(linear.TILES)] + [
    ("matmul", tile, False) for tile in sorted(linear.TILES)]
# Ragged shapes (scalar loads) and shapes whose dims are all multiples of 4 (vec4 loads at every transpose):
# edge tiles in M and N, K not a multiple of the K tile, many K tiles (both shared buffers), exact tiles.
MATMUL_SHAPES = [(1, 5, 3, 1), (65, 17, 130, 1), (70, 129, 66, 1), (130, 300, 7, 3), (9, 1000, 140, 4),
                 (132, 100, 260, 1), (128, 64, 128, 1), (36, 1040, 12, 3), (4, 4, 4, 1), (192, 264, 68, 2)]


@pytest.mark.parametrize("kernel,tile,vec4", MATMUL_KERNELS, ids=lambda v: str(v))
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("M,K,N,split_k", MATMUL_SHAPES)
def test_every_matmul_kernel_transpose_and_k_split(rt, rng, kernel, tile, vec4, ta, tb, M, K, N, split_k):
    """All kernels run on every adapter here, whichever one the adapter type selects by default."""
    skip_without_subgroups(rt, kernel)
    (a32, a), (b32, b), (bias32, bias), (acc32, acc) = (
        f32(rng, *((K, M) if ta else (M, K))), f32(rng, *((N, K) if tb else (K, N))), f32(rng, N), f32(rng, M, N))
    ref = (a.T if ta else a) @ (b.T if tb else b)
    ga, gb = rt.from_numpy(a32), rt.from_numpy(b32)
    kw = dict(trans_a=ta, trans_b=tb, kernel=kernel, tile=tile, vec4=vec4)
    if split_k == 1:
        got = linear.matmul(ga, gb, bias=rt.from_numpy(bias32), **kw).numpy()
        assert rel(got, ref + bias) < REDUCTION_TOL
    got = linear.matmul(ga, gb, split_k=split_k, **kw).numpy()
    assert rel(got, ref) < REDUCTION_TOL
    out = rt.from_numpy(acc32)
    linear.matmul(ga, gb, out=out, split_k=split_k, **kw)
    assert rel(out.numpy(), acc + ref) < REDUCTION_TOL


# K: one vec4 (no full group), ragged against the 4 × 32-vec4 main loop (its remainder loop), several main-loop
# steps; N: below, at and past the 8 columns of a workgroup.
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("K,N", [(4, 1), (12, 8), (516, 9), (2048, 300)])
def test_matvec_few_rows_times_a_transposed_weight(rt, rng, M, K, N):
    """GPUs' pick for decoding (at most MATVEC_ROWS rows times Bᵀ): with a bias, accumulating, and by default."""
    (a32, a), (b32, b), (bias32, bias), (acc32, acc) = f32(rng, M, K), f32(rng, N, K), f32(rng, N), f32(rng, M, N)
    ga, gb = rt.from_numpy(a32), rt.from_numpy(b32)
    ref = a @ b.T
    assert rel(linear.matmul(ga, gb, trans_b=True, kernel="matvec").numpy(), ref) < REDUCTION_TOL
    got = linear.matmul(ga, gb, trans_b=True, kernel="matvec", bias=rt.from_numpy(bias32)).numpy()
    assert rel(got, ref + bias) < REDUCTION_TOL
    out = rt.from_numpy(acc32)
    linear.matmul(ga, gb, trans_b=True, kernel="matvec", out=out)
    assert rel(out.numpy(), acc + ref) < REDUCTION_TOL
    assert rel(linear.linear(ga, gb, rt.from_numpy(bias32)).numpy(), ref + bias) < REDUCTION_TOL  # the default (matvec on GPUs)


def test_matvec_refuses_what_it_does_not_compute(rt, rng):
    a, b = rt.from_numpy(f32(rng, 5, 8)[0]), rt.from_numpy(f32(rng, 3, 8)[0])
    with pytest.raises(ShapeError, match="matvec needs A"):
        linear.matmul(a, b, trans_b=True, kernel="matvec")  # 5 rows
    with pytest.raises(ShapeError, match="matvec needs A"):
        linear.matmul(a.reshape(8, 5), b, trans_a=True, trans_b=True, kernel="matvec")
    with pytest.raises(ShapeError, match="matvec needs A"):
        linear.matmul(rt.from_numpy(f32(rng, 2, 6)[0]), rt.from_numpy(f32(rng, 3, 6)[0]), trans_b=True,
                      kernel="matvec")  # K not a multiple of 4


@pytest.mark.parametrize("tile", sorted(linear.TILES))
@pytest.mark.parametrize("raster", [False, True])
@pytest.mark.parametrize("M,K,N,split_k", [(70, 129, 300, 1), (200, 1040, 36, 2)])
def test_matmul_raster_either_way(rt, rng, tile, raster, M, K, N, split_k):
    """Workgroup x walking row tiles or column tiles gives the same product (every transpose)."""
    for ta, tb in [(False, False), (True, False), (False, True), (True, True)]:
        (a32, a), (b32, b) = f32(rng, *((K, M) if ta else (M, K))), f32(rng, *((N, K) if tb else (K, N)))
        got = linear.matmul(rt.from_numpy(a32), rt.from_numpy(b32), trans_a=ta, trans_b=tb, kernel="matmul",
                            tile=tile, raster=raster, split_k=split_k).numpy()
        assert rel(got, (a.T if ta else a) @ (b.T if tb else b)) < REDUCTION_TOL


def test_matmul_vec4_only_where_rows_align(rt, rng):
    """The wrapper takes the vec4 path exactly when N and A's and B's contiguous dims are multiples of 4,
    and refuses to force it elsewhere."""
    assert linear.vec4_ok(8, 12, 16, False, False) and linear.vec4_ok(8, 12, 16, True, True)
    assert not linear.vec4_ok(8, 13, 16, False, False)  # N (C's rows, B's rows)
    assert not linear.vec4_ok(8, 12, 18, False, False)  # K (A's rows)
    assert linear.vec4_ok(8, 12, 18, True, False)  # K is contiguous in neither Aᵀ [K, M] nor B [K, N]
    assert not linear.vec4_ok(9, 12, 16, True, False)  # M (Aᵀ's rows)
    assert not linear.vec4_ok(8, 12, 18, False, True)  # K (Bᵀ's rows)
    x = rt.from_numpy(rng.standard_normal((8, 18)).astype(np.float32))
    w = rt.from_numpy(rng.standard_normal((12, 18)).astype(np.float32))
    with pytest.raises(ShapeError, match="vec4"):
        linear.matmul(x, w, trans_b=True, kernel="matmul", vec4=True)


def skip_without_subgroups(rt, kernel):
    if kernel == "matmul_subgroup" and rt.subgroup_size != 8:
        pytest.skip(f"matmul_subgroup needs 8-lane subgroups (this adapter: {rt.subgroup_size})")


@pytest.mark.parametrize("kernel", linear.CPU_KERNELS)
@pytest.mark.parametrize("trans_a", [False, True])
def test_matmul_direct_k_past_the_software_adapters_loop_budget(rt, rng, trans_a, kernel):
    """matmul_direct and matmul_subgroup walk their K range in one loop; Mesa llvmpipe cuts loops past 65,535
    iterations per invocation (it was 18% off at K = 70,000), so there the K range is split across workgroups."""
    skip_without_subgroups(rt, kernel)
    K = 70_000
    (a32, a), (b32, b) = f32(rng, *((K, 3) if trans_a else (3, K))), f32(rng, K, 5)
    got = linear.matmul(rt.from_numpy(a32), rt.from_numpy(b32), trans_a=trans_a, kernel=kernel).numpy()
    assert rel(got, (a.T if trans_a else a) @ b) < REDUCTION_TOL


def test_matmul_direct_forced_k_segments(rt, rng, monkeypatch):
    """The split path on any adapter: K ranges of 32 (forced) summed in order give the same product."""
    monkeypatch.setattr(checks, "FORCE_SEGMENT", 32)
    (a32, a), (b32, b), (acc32, acc) = f32(rng, 9, 200), f32(rng, 7, 200), f32(rng, 9, 7)
    out = rt.from_numpy(acc32)
    linear.matmul(rt.from_numpy(a32), rt.from_numpy(b32), trans_b=True, kernel="matmul_direct", out=out)
    assert rel(out.numpy(), acc + a @ b.T) < REDUCTION_TOL


def test_matmul_direct_refuses_an_unsplittable_k_on_llvmpipe(rt, rng, monkeypatch):
    monkeypatch.setattr(checks, "FORCE_SEGMENT", 32)
    if not checks.is_llvmpipe(rt):
        monkeypatch.setattr(checks, "is_llvmpipe", lambda _rt: True)
    a, b, bias = (rt.from_numpy(f32(rng, *s)[0]) for s in ((3, 70_000), (5, 70_000), (5,)))
    with pytest.raises(ShapeError, match=r"matmul: shape \(3, 70000, 5\) needs up to 70000 loop iterations"):
        linear.matmul(a, b, trans_b=True, bias=bias, kernel="matmul_direct")


@pytest.mark.parametrize("kernel", linear.CPU_KERNELS)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_direct_edge_blocks(rt, rng, ta, tb, kernel):
    """matmul_direct's 32-row × 16-column blocks and matmul_subgroup's 8-row × 64-column ones: outputs that end
    inside a block in both dimensions, in several workgroups (their loads read clamped rows and columns, whose
    results must never be stored), a single-row and a single-column output, and the poisoned output shows any
    element left unwritten."""
    skip_without_subgroups(rt, kernel)
    for M, K, N in [(97, 45, 83), (1, 33, 70), (70, 33, 1), (33, 7, 17), (9, 5, 129)]:
        (a32, a), (b32, b) = f32(rng, *((K, M) if ta else (M, K))), f32(rng, *((N, K) if tb else (K, N)))
        got = linear.matmul(rt.from_numpy(a32), rt.from_numpy(b32), trans_a=ta, trans_b=tb, kernel=kernel).numpy()
        assert got.shape == (M, N)
        assert rel(got, (a.T if ta else a) @ (b.T if tb else b)) < REDUCTION_TOL


def test_matmul_subgroup_reads_arena_views_through_textures_and_falls_back_where_they_do_not_fit(rt, rng, monkeypatch):
    """matmul_subgroup reads A and B through textures that the runtime fills from the tensors' bytes before the
    dispatch: views at an Arena's offsets (a model's weights), an operand over several texture rows that ends inside
    one, every transpose. An operand whose texture would pass the device's 2-D limit takes matmul_direct."""
    from mambactl.runtime.arena import Arena
    from mambactl.runtime.gpu import TEXTURE_ROW

    skip_without_subgroups(rt, "matmul_subgroup")
    K = 4100
    arena = Arena(rt, [(3,), (36, K), (40, 36)])
    (w32, w), (v32, v), (x32, x) = f32(rng, 36, K), f32(rng, 40, 36), f32(rng, 9, K)
    rt.write(arena.tensors[1], w32)
    rt.write(arena.tensors[2], v32)
    gw, gv, gx = arena.tensors[1], arena.tensors[2], rt.from_numpy(x32)
    assert gw.offset and gw.size > 4 * TEXTURE_ROW and gw.size % (4 * TEXTURE_ROW)  # several rows, the last partial
    assert linear.cpu_kernel(rt, gx, gw) == "matmul_subgroup"
    y = linear.matmul(gx, gw, trans_b=True)
    assert rel(y.numpy(), x @ w.T) < REDUCTION_TOL
    assert rel(linear.matmul(y, gw).numpy(), x @ w.T @ w) < REDUCTION_TOL
    assert rel(linear.matmul(gx, y, trans_a=True).numpy(), x.T @ x @ w.T) < REDUCTION_TOL
    assert rel(linear.matmul(y, gv, trans_b=True).numpy(), x @ w.T @ v.T) < REDUCTION_TOL
    monkeypatch.setitem(rt.limits, "max-texture-dimension-2d", 2)  # gw needs 10 rows
    assert not rt.fits_texture(gw) and rt.fits_texture(gv)
    assert linear.cpu_kernel(rt, gx, gw) == "matmul_direct"
    assert rel(linear.matmul(gx, gw, trans_b=True).numpy(), x @ w.T) < REDUCTION_TOL


def test_linear_backward_accumulates(rt, rng):
    (x32, x), (w32, w), (dy32, dy), (acc32, acc), (bacc32, bacc) = (
        f32(rng, 9, 7), f32(rng, 5, 7), f32(rng, 9, 5), f32(rng, 5, 7), f32(rng, 5))
    dw, db = rt.from_numpy(acc32), rt.from_numpy(bacc32)
    linear.linear_backward(rt.from_numpy(x32), rt.from_numpy(w32), rt.from_numpy(dy32), dw=dw, db=db, need_dx=False)
    _, rdw, rdb = ref_linear.linear_backward(x, w, dy)
    assert rel(dw.numpy(), acc + rdw) < REDUCTION_TOL
    assert rel(db.numpy(), bacc + rdb) < REDUCTION_TOL


@pytest.mark.parametrize("rows_path", [False, True], ids=["workgroup_per_row", "invocation_per_row"])
@pytest.mark.parametrize("M,D", [(1, 3), (3, 17), (65, 130), (4, 768), (1030, 5)])
@pytest.mark.parametrize("fused", [False, True], ids=["alone", "with_residual_add"])
def test_rmsnorm_forward_backward(rt, rng, M, D, rows_path, fused):
    """RMSNorm alone, and add_rmsnorm (h = x + residual normalised, h written) with the backward's add_to; row
    counts that leave a ragged last block of rows (GPU blocks of 8; 2 rows per CPU invocation at 1030), dw added
    into a given accumulator."""
    (x32, x), (w32, w), (dy32, dy) = f32(rng, M, D), f32(rng, D), f32(rng, M, D)
    (r32, r), (dh32, dh), (acc32, acc) = f32(rng, M, D), f32(rng, M, D), f32(rng, D)
    gx, gw = rt.from_numpy(x32), rt.from_numpy(w32)
    if fused:
        gh, y, rstd = rmsnorm.add_rmsnorm(gx, rt.from_numpy(r32), gw, eps=1e-5, rows_path=rows_path)
        h, ry = ref_norm.add_rmsnorm(x, r, w, 1e-5)
        np.testing.assert_array_equal(gh.numpy(), x32 + r32)
        h32 = x32 + r32
    else:
        y, rstd = rmsnorm.rmsnorm(gx, gw, eps=1e-5, rows_path=rows_path)
        gh, h, h32, ry = gx, x, x32, ref_norm.rmsnorm(x, w, 1e-5)
    assert rel(y.numpy(), ry) < ELEMENTWISE_TOL
    dx, dw = rmsnorm.rmsnorm_backward(gh, gw, rstd, rt.from_numpy(dy32), dw=rt.from_numpy(acc32), rows_path=rows_path,
                                      add_to=rt.from_numpy(dh32) if fused else None)
    rdx, rdw = ref_norm.rmsnorm_backward(h32.astype(np.float64), w, dy, 1e-5, add_to=dh if fused else None)
    assert rel(dx.numpy(), rdx) < REDUCTION_TOL
    assert rel(dw.numpy(), rdw + acc) < REDUCTION_TOL


def _columns_of(rng, x32, pad_left, pad_right):
    """x32 [B, L, C] placed in columns [pad_left, pad_left + C) of a wider random matrix (as in_proj's output)."""
    B, L, C = x32.shape
    wide = rng.standard_normal((B, L, pad_left + C + pad_right)).astype(np.float32)
    wide[:, :, pad_left:pad_left + C] = x32
    return wide


CONV_PATHS = [(False, None), (True, None), (True, 2), (True, 5)]  # (walk, steps per walk invocation)
CONV_PATH_IDS = ["per_output", "walk", "walk_seg2", "walk_seg5"]


@pytest.mark.parametrize("walk,segment", CONV_PATHS, ids=CONV_PATH_IDS)
@pytest.mark.parametrize("B,L,C,K", [(1, 1, 1, 4), (2, 3, 17, 4), (1, 65, 3, 2), (3, 17, 130, 4), (2, 9, 5, 1),
                                     (2, 2, 3, 3)])
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "columns"])
def test_conv1d_forward_backward(rt, rng, B, L, C, K, walk, segment, strided):
    """The per-output kernels and the walks over time (K ≤ 4: L shorter than the window too; segments shorter
    than the window), reading x from columns of a wider matrix and writing dx into columns of another."""
    (x32, x), (w32, w), (b32, b), (dy32, dy) = f32(rng, B, L, C), f32(rng, C, K), f32(rng, C), f32(rng, B, L, C)
    gw = rt.from_numpy(w32)
    kw = dict(walk=walk, segment=segment)
    if strided:
        gx, kw["x_start"] = rt.from_numpy(_columns_of(rng, x32, 3, 2)), 3
        dx_wide = _columns_of(rng, np.zeros_like(x32), 1, 4)
        kw_dx = dict(dx_out=(rt.from_numpy(dx_wide), 1))
    else:
        gx, kw_dx = rt.from_numpy(x32), {}
    assert rel(conv1d.conv1d(gx, gw, rt.from_numpy(b32), **kw).numpy(), ref_conv.conv1d(x, w, b)) < ELEMENTWISE_TOL
    dx, dw, db = conv1d.conv1d_backward(gx, gw, rt.from_numpy(dy32), **kw, **kw_dx)
    rdx, rdw, rdb = ref_conv.conv1d_backward(x, w, dy)
    if strided:  # the other columns of dx_out are untouched
        dx = dx.numpy()
        np.testing.assert_array_equal(np.delete(dx, range(1, 1 + C), axis=2), np.delete(dx_wide, range(1, 1 + C), axis=2))
        dx = dx[:, :, 1:1 + C]
    else:
        dx = dx.numpy()
    assert rel(dx, rdx) < REDUCTION_TOL
    assert rel(dw.numpy(), rdw) < REDUCTION_TOL
    assert rel(db.numpy(), rdb) < REDUCTION_TOL


@pytest.mark.parametrize("walk,segment", CONV_PATHS, ids=CONV_PATH_IDS)
@pytest.mark.parametrize("B,L,C,K", [(1, 1, 1, 4), (2, 3, 17, 4), (3, 17, 130, 4), (2, 9, 5, 1)])
@pytest.mark.parametrize("two_grads", [False, True], ids=["one_grad", "two_grads"])
def test_conv1d_silu_forward_backward(rt, rng, B, L, C, K, walk, segment, two_grads):
    """SiLU(conv1d) and its backward from one or two gradients of the activation, x read from columns of a wider
    matrix and dx written into columns of another: fused in the walks (the backward recomputes the conv), conv1d,
    silu, add and silu_backward kernels on the per-output path."""
    (x32, x), (w32, w), (b32, b) = f32(rng, B, L, C), f32(rng, C, K), f32(rng, C)
    (da32, da), (db32, db_) = f32(rng, B, L, C), f32(rng, B, L, C)
    gx, gw, gb = rt.from_numpy(_columns_of(rng, x32, 2, 1)), rt.from_numpy(w32), rt.from_numpy(b32)
    kw = dict(x_start=2, walk=walk, segment=segment)
    act = conv1d.conv1d_silu(gx, gw, gb, **kw)
    assert rel(act.numpy(), ref_conv.conv1d_silu(x, w, b)) < ELEMENTWISE_TOL
    dx_out = rt.from_numpy(_columns_of(rng, np.zeros_like(x32), 0, 3))
    dx, dw, dbias = conv1d.conv1d_silu_backward(gx, gw, gb, rt.from_numpy(da32), rt.from_numpy(db32) if two_grads
                                                else None, dx_out=(dx_out, 0), **kw)
    rdx, rdw, rdb = ref_conv.conv1d_silu_backward(x, w, b, da, db_ if two_grads else None)
    assert rel(dx.numpy()[:, :, :C], rdx) < REDUCTION_TOL
    assert rel(dw.numpy(), rdw) < REDUCTION_TOL
    assert rel(dbias.numpy(), rdb) < REDUCTION_TOL


@pytest.mark.parametrize("walk,segment", CONV_PATHS, ids=CONV_PATH_IDS)
@pytest.mark.parametrize("parts", [(5, 2, 6), (9, 4), (13,)], ids=["three", "two", "one"])
def test_conv1d_silu_in_parts(rt, rng, parts, walk, segment):
    """SiLU(conv1d) written as separate tensors per channel range and its backward reading the gradients of the
    ranges where they are (Mamba-2's x, B, C): the same numbers as the whole."""
    B, L, C, K = 2, 11, sum(parts), 4
    (x32, x), (w32, w), (b32, b), (da32, da) = f32(rng, B, L, C), f32(rng, C, K), f32(rng, C), f32(rng, B, L, C)
    gx, gw, gb = rt.from_numpy(_columns_of(rng, x32, 1, 2)), rt.from_numpy(w32), rt.from_numpy(b32)
    kw = dict(x_start=1, walk=walk, segment=segment)
    outs = conv1d.conv1d_silu(gx, gw, gb, parts=list(parts), **kw)
    edges = np.cumsum((0,) + parts)
    act = ref_conv.conv1d_silu(x, w, b)
    assert [o.shape for o in outs] == [(B, L, n) for n in parts]
    for o, lo, hi in zip(outs, edges[:-1], edges[1:]):
        assert rel(o.numpy(), act[:, :, lo:hi]) < ELEMENTWISE_TOL
    pieces = [rt.from_numpy(np.ascontiguousarray(da32[:, :, lo:hi])) for lo, hi in zip(edges[:-1], edges[1:])]
    dx, dw, dbias = conv1d.conv1d_silu_backward(gx, gw, gb, pieces, **kw)
    rdx, rdw, rdb = ref_conv.conv1d_silu_backward(x, w, b, da)
    assert rel(dx.numpy(), rdx) < REDUCTION_TOL
    assert rel(dw.numpy(), rdw) < REDUCTION_TOL
    assert rel(dbias.numpy(), rdb) < REDUCTION_TOL
    with pytest.raises(ShapeError, match="conv1d_silu: parts"):
        conv1d.conv1d_silu(gx, gw, gb, parts=[C, 1], **kw)


@pytest.mark.parametrize("textured", [False, True], ids=["buffers", "textures"])
@pytest.mark.parametrize("parts", [None, (5, 2, 6)], ids=["two_grads", "parts"])
def test_conv1d_walks_read_buffers_or_textures_alike(rt, rng, monkeypatch, textured, parts):
    """The walks read x and the gradients from the buffers on GPUs and through textures on CPU adapters; either
    way, on any adapter, they give the reference's numbers (x in columns of a wider matrix; Mamba-1's two gradients
    or Mamba-2's three parts)."""
    if textured:
        monkeypatch.setattr(conv1d, "is_cpu", lambda _rt: True)  # _walk_textures' test (the segment rule's too)
    else:
        monkeypatch.setattr(conv1d, "_walk_textures", lambda _rt, t: (False, {n + "_tex": None for n in t}))
    B, L, C, K = 2, 11, 13, 4
    (x32, x), (w32, w), (b32, b) = f32(rng, B, L, C), f32(rng, C, K), f32(rng, C)
    (da32, da), (db32, db_) = f32(rng, B, L, C), f32(rng, B, L, C)
    gx, gw, gb = rt.from_numpy(_columns_of(rng, x32, 1, 2)), rt.from_numpy(w32), rt.from_numpy(b32)
    kw = dict(x_start=1, walk=True)
    edges = np.cumsum((0,) + (parts or (C,)))
    outs = conv1d.conv1d_silu(gx, gw, gb, parts=list(parts) if parts else None, **kw)
    act = ref_conv.conv1d_silu(x, w, b)
    for o, lo, hi in zip(outs if parts else [outs], edges[:-1], edges[1:]):
        assert rel(o.numpy(), act[:, :, lo:hi]) < ELEMENTWISE_TOL
    if parts:
        dact = [rt.from_numpy(np.ascontiguousarray(da32[:, :, lo:hi])) for lo, hi in zip(edges[:-1], edges[1:])]
        dx, dw, dbias = conv1d.conv1d_silu_backward(gx, gw, gb, dact, **kw)
        rdx, rdw, rdb = ref_conv.conv1d_silu_backward(x, w, b, da)
    else:
        dx, dw, dbias = conv1d.conv1d_silu_backward(gx, gw, gb, rt.from_numpy(da32), rt.from_numpy(db32), **kw)
        rdx, rdw, rdb = ref_conv.conv1d_silu_backward(x, w, b, da, db_)
    assert rel(dx.numpy(), rdx) < REDUCTION_TOL
    assert rel(dw.numpy(), rdw) < REDUCTION_TOL
    assert rel(dbias.numpy(), rdb) < REDUCTION_TOL


def test_conv1d_walk_accumulates_and_checks_columns(rt, rng):
    """dw, db given are added into; a column range outside x or dx_out is a ShapeError naming the op."""
    (x32, x), (w32, w), (b32, b), (dy32, dy) = f32(rng, 2, 7, 5), f32(rng, 5, 4), f32(rng, 5), f32(rng, 2, 7, 5)
    gx, gw = rt.from_numpy(x32), rt.from_numpy(w32)
    (dw0, _), (db0, _) = f32(rng, 5, 4), f32(rng, 5)
    _, dw, db = conv1d.conv1d_backward(gx, gw, rt.from_numpy(dy32), rt.from_numpy(dw0), rt.from_numpy(db0))
    _, rdw, rdb = ref_conv.conv1d_backward(x, w, dy)
    assert rel(dw.numpy(), rdw + dw0) < REDUCTION_TOL
    assert rel(db.numpy(), rdb + db0) < REDUCTION_TOL
    with pytest.raises(ShapeError, match="conv1d: x channels"):
        conv1d.conv1d(gx, gw, rt.from_numpy(b32), x_start=1)
    with pytest.raises(ShapeError, match="conv1d_backward: dx_out columns"):
        conv1d.conv1d_backward(gx, gw, rt.from_numpy(dy32), dx_out=(rt.empty((2, 7, 6)), 2))


@pytest.mark.parametrize("K", [1, 2, 4])
def test_conv1d_state_and_steps_continue_the_sequence(rt, rng, K):
    """The decode state after a prefill of L steps, advanced one token at a time, gives the outputs the
    parallel conv gives at positions L, L + 1, ... (L shorter and longer than the window); x is read from columns
    [2, 9) of wider rows, as the models pass in_proj's output."""
    for L in (1, 5):
        (x32, x), (w32, w), (b32, b) = f32(rng, 2, L + 3, 7), f32(rng, 7, K), f32(rng, 7)
        wide = _columns_of(rng, x32, 2, 3)
        full = ref_conv.conv1d(x, w, b)
        gw, gb = rt.from_numpy(w32), rt.from_numpy(b32)
        state = conv1d.conv1d_state(rt.from_numpy(np.ascontiguousarray(wide[:, :L])), K, x_start=2, channels=7)
        for t in range(L, L + 3):
            y = conv1d.conv1d_step(state, rt.from_numpy(np.ascontiguousarray(wide[:, t])), gw, gb, x_start=2)
            assert rel(y.numpy(), full[:, t]) < ELEMENTWISE_TOL


@pytest.mark.parametrize("parts", [None, [7], [3, 4], [2, 1, 4]])
def test_conv1d_step_with_silu_in_parts(rt, rng, parts):
    """The decoding step's SiLU and channel parts (Mamba-2's x, B, C) equal SiLU of the parallel conv, split."""
    (x32, x), (w32, w), (b32, b) = f32(rng, 2, 6, 7), f32(rng, 7, 4), f32(rng, 7)
    wide = _columns_of(rng, x32, 2, 3)
    full = ref_act.silu(ref_conv.conv1d(x, w, b))
    gw, gb = rt.from_numpy(w32), rt.from_numpy(b32)
    state = conv1d.conv1d_state(rt.from_numpy(np.ascontiguousarray(wide[:, :3])), 4, x_start=2, channels=7)
    for t in range(3, 6):
        out = conv1d.conv1d_step(state, rt.from_numpy(np.ascontiguousarray(wide[:, t])), gw, gb, x_start=2, silu=True,
                                 parts=parts)
        got = np.concatenate([o.numpy() for o in out], axis=1) if parts else out.numpy()
        assert [o.shape[1] for o in out] == parts if parts else got.shape == (2, 7)
        assert rel(got, full[:, t]) < ELEMENTWISE_TOL
    with pytest.raises(ShapeError, match="parts"):
        conv1d.conv1d_step(state, rt.from_numpy(np.ascontiguousarray(wide[:, 0])), gw, gb, x_start=2, parts=[3, 3])


def test_conv1d_taps_follow_pytorch(rt):
    """Tap K−1 multiplies the current step (PyTorch), not tap 0 (the old engine's reversed convention)."""
    x = np.zeros((1, 5, 1), np.float32)
    x[0, 2, 0] = 1.0
    w = np.array([[1.0, 2.0, 3.0]], np.float32)
    y = conv1d.conv1d(rt.from_numpy(x), rt.from_numpy(w), rt.from_numpy(np.zeros(1, np.float32))).numpy()
    np.testing.assert_array_equal(y[0, :, 0], [0, 0, 3, 2, 1])


@pytest.mark.parametrize("rows_path", [False, True], ids=["per_element", "per_row"])
@pytest.mark.parametrize("M,P,start,width", [(1, 5, 1, 3), (3, 17, 0, 17), (65, 130, 64, 66), (9, 24, 8, 12)])
def test_column_slice_and_backward(rt, rng, M, P, start, width, rows_path):
    x32, x = f32(rng, M, P)
    got = slice.column_slice(rt.from_numpy(x32), start, width, rows_path=rows_path).numpy()
    np.testing.assert_array_equal(got, ref_slice.column_slice(x, start, width))
    dy32, dy = f32(rng, M, width)
    back = slice.column_slice_backward(rt.from_numpy(dy32), start, P, rows_path=rows_path).numpy()
    np.testing.assert_array_equal(back, ref_slice.column_slice_backward(dy, start, P))


@pytest.mark.parametrize("shape,start,rows", [((64, 8), 4, 3), ((6, 5), 2, 4), ((9,), 3, 5), ((7, 2, 3), 1, 6),
                                               ((5, 3), 0, 5)], ids=["view", "copy", "bias", "3d", "whole"])
def test_row_block(rt, rng, shape, start, rows):
    """Rows of a weight or bias: a view where its byte offset can be bound (the same buffer), else a copy (another);
    either holds exactly those rows."""
    x32 = rng.standard_normal(shape).astype(np.float32)
    x = rt.from_numpy(x32)
    got = slice.row_block(x, start, rows)
    np.testing.assert_array_equal(got.numpy(), x32[start:start + rows])
    offset = start * (x32.size // shape[0]) * 4
    assert (got.buffer is x.buffer) == (offset % int(rt.limits["min-storage-buffer-offset-alignment"]) == 0)
    with pytest.raises(ShapeError, match="row_block: rows"):
        slice.row_block(x, start, shape[0] - start + 1)


@pytest.mark.parametrize("rows_path", [False, True], ids=["per_element", "per_row"])
@pytest.mark.parametrize("widths", [(3, 1, 17), (5,), (2, 9), (4, 1, 3, 8, 2), (8, 4, 12), (4,)],
                         ids=["three", "one", "two", "five", "vec4_three", "vec4_one"])
def test_column_concat_and_split(rt, rng, widths, rows_path):
    """Up to three parts per pass (five take two); concat into the middle of a wider matrix, with accumulation, and
    its inverse, the split, from a column offset (all multiples of 4 for the vec4 cases: the vec4 kernels)."""
    parts = [f32(rng, 7, w) for w in widths]
    got = slice.column_concat([rt.from_numpy(p32) for p32, _ in parts], rows_path=rows_path).numpy()
    np.testing.assert_array_equal(got, ref_slice.column_concat([p for _, p in parts]))
    (base32, base), total = f32(rng, 7, sum(widths) + 8), sum(widths)
    into = slice.column_concat([rt.from_numpy(p32) for p32, _ in parts], rt.from_numpy(base32), 4, accumulate=True,
                               rows_path=rows_path)
    want = base.copy()
    want[:, 4:4 + total] += ref_slice.column_concat([p for _, p in parts])
    np.testing.assert_array_equal(into.numpy(), want.astype(np.float32))
    split = slice.column_split(rt.from_numpy(base32), list(widths), 4, rows_path=rows_path)
    for g, r in zip(split, ref_slice.column_split(base, widths, 4)):
        np.testing.assert_array_equal(g.numpy(), r)
    with pytest.raises(ShapeError, match="column_split: widths"):
        slice.column_split(rt.from_numpy(base32), list(widths), 9)
    with pytest.raises(ShapeError, match="column_concat: columns"):
        slice.column_concat([rt.from_numpy(p32) for p32, _ in parts], rt.from_numpy(base32), 9)


@pytest.mark.parametrize("T,V,D", [(1, 2, 1), (17, 5, 3), (130, 65, 17)])
def test_embedding_forward_backward(rt, rng, T, V, D):
    ids = rng.integers(0, V, T)
    (tab32, tab), (dy32, dy), (acc32, acc) = f32(rng, V, D), f32(rng, T, D), f32(rng, V, D)
    gids = rt.from_numpy(embedding.check_ids(ids, V))
    out = embedding.embedding(gids, rt.from_numpy(tab32)).numpy()
    np.testing.assert_array_equal(out, ref_emb.embedding(ids, tab))
    d_table = rt.from_numpy(acc32)  # the scatter adds into what is there (the tied head's gradient)
    embedding.embedding_backward(embedding.EmbeddingGradPlan(rt, ids), rt.from_numpy(dy32), d_table)
    assert rel(d_table.numpy(), acc + ref_emb.embedding_backward(ids, dy, V)) < REDUCTION_TOL


@pytest.mark.parametrize("rows_path", [False, True], ids=["workgroup_per_row", "invocation_per_row"])
@pytest.mark.parametrize("M,V", [(1, 3), (17, 65), (65, 1000), (3, 5000), (5, 12)])  # V % 4 == 0 (1000, 5000, 12): vec4 backward
def test_cross_entropy_forward_backward(rt, rng, M, V, rows_path):
    lg32, lg = f32(rng, M, V, scale=3.0)
    if M > 2:
        lg32[M // 2, ::7] = 60.0  # a row whose running max jumps (the online softmax rescales its sum)
    lg = lg32.astype(np.float64)
    targets = rng.integers(0, V, M).astype(np.int32)
    targets[1::3] = cross_entropy.IGNORE_INDEX
    count = cross_entropy.count_targets(targets)
    gl, gt = rt.from_numpy(lg32), rt.from_numpy(targets)
    loss, lse = cross_entropy.cross_entropy(gl, gt, count, rows_path=rows_path)
    assert rel(loss.numpy(), [ref_ce.cross_entropy(lg, targets)]) < REDUCTION_TOL
    assert rel(lse.numpy(), np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)) < REDUCTION_TOL
    d = cross_entropy.cross_entropy_backward(gl, gt, lse, count, rows_path=rows_path).numpy()
    assert rel(d, ref_ce.cross_entropy_backward(lg, targets)) < REDUCTION_TOL
    assert np.all(d[targets == cross_entropy.IGNORE_INDEX] == 0.0)


def skip_subgroup_reduce(rt, subgroup):
    if subgroup and rt.subgroup_size != 8:
        pytest.skip(f"reduce_partial_subgroup needs 8-lane subgroups (this adapter: {rt.subgroup_size})")


@pytest.mark.parametrize("subgroup", [False, True])
def test_sum_of_squares_many_tensors(rt, rng, subgroup):
    """Both first passes (the tree of barriers, the barrier-free subgroup one) on every adapter that has them;
    1,100,000 elements give the subgroup pass more than 256 partials."""
    skip_subgroup_reduce(rt, subgroup)
    xs = [f32(rng, n) for n in (1, 3, 300, 70_000, 300_000, 1_100_000)]
    got = reduce.sum_of_squares([rt.from_numpy(x32) for x32, _ in xs], subgroup=subgroup).numpy()
    assert rel(got, [sum(ref_reduce.sum_of_squares(x) for _, x in xs)]) < REDUCTION_TOL


@pytest.mark.parametrize("subgroup", [False, True])
def test_reduce_sum(rt, rng, subgroup):
    skip_subgroup_reduce(rt, subgroup)
    x32, x = f32(rng, 100_003)
    got = reduce.reduce_sum(rt.from_numpy(x32), scale=0.5, subgroup=subgroup).numpy()
    assert rel(got, [0.5 * x.sum()]) < REDUCTION_TOL


def test_subgroup_reduce_refused_without_8_lanes(rt, rng, monkeypatch):
    monkeypatch.setattr(rt, "_subgroup_size", 0)  # as an adapter without the subgroup feature
    with pytest.raises(ShapeError, match="reduce: the subgroup pass needs 8-lane subgroups"):
        reduce.reduce_sum(rt.from_numpy(f32(rng, 10)[0]), subgroup=True)


def test_fill_and_zeros(rt):
    t = fill.zeros(rt, (3, 70_000))
    assert np.count_nonzero(t.numpy()) == 0
    fill.fill(t, 2.5)
    assert np.all(t.numpy() == 2.5)
    rt.fill(t, np.nan)  # poisoned: a zero fill (a buffer clear) must write every element
    fill.fill(t, 0.0)
    assert np.count_nonzero(t.numpy()) == 0


def test_zero_fill_of_a_view_leaves_its_neighbours(rt):
    """A clear covers the view's bytes only, ordered with the dispatches recorded before and after it."""
    align = int(rt.limits["min-storage-buffer-offset-alignment"]) // 4
    values = np.random.default_rng(0).standard_normal(4 * align).astype(np.float32)
    whole = rt.from_numpy(values)
    before = activations.silu(whole)  # a dispatch before the clear, reading the buffer it will clear
    fill.fill(whole.view(align, (2 * align,)), 0.0)
    after = activations.silu(whole)  # and one after, reading the cleared elements
    want = values.copy()
    want[align:3 * align] = 0.0
    np.testing.assert_array_equal(whole.numpy(), want)
    silu = lambda v: v.astype(np.float64) / (1 + np.exp(-v.astype(np.float64)))  # noqa: E731
    np.testing.assert_allclose(before.numpy(), silu(values), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(after.numpy(), silu(want), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("textures", [True, False])
@pytest.mark.parametrize("R,n", [(1, 3), (5, 65), (8, 9), (31, 5), (32, 7), (33, 130), (130, 1), (1030, 66),
                                 (1, 4), (31, 8), (33, 132), (1030, 260)])
def test_column_sums(rt, rng, monkeypatch, R, n, textures):
    """One pass up to 32 rows, two over ⌈√R⌉-row blocks above (ragged last blocks; 31 rows: a 16-row step, the
    8-row step, a 4-row step and a tail of 3), fresh and added into an accumulator. CPU adapters read a matrix of
    4k columns through a texture (column_sums_texels; 260 columns: a second workgroup of them); "no textures"
    forces the buffer kernel there too."""
    if textures and not (checks.is_cpu(rt) and n % 4 == 0):
        pytest.skip("column sums read a texture on CPU adapters, for a multiple of 4 columns")
    if not textures:
        monkeypatch.setattr(rt, "fits_texture", lambda *tensors: False)
    (x32, x), (acc32, acc) = f32(rng, R, n), f32(rng, n)
    assert rel(reduce.column_sums(rt.from_numpy(x32)).numpy(), x.sum(0)) < REDUCTION_TOL
    assert rel(reduce.column_sums(rt.from_numpy(x32), rt.from_numpy(acc32)).numpy(), acc + x.sum(0)) < REDUCTION_TOL


def test_conv1d_walks_past_the_software_adapters_loop_budget(rt, rng):
    """L = 70,000 > llvmpipe's 65,535 loop iterations per invocation: on CPU adapters the walks split the sequence
    into segments within the budget (inside one dispatch), so SiLU(conv) and its backward still match."""
    B, L, C, K = 1, 70_000, 3, 4
    (x32, x), (w32, w), (b32, b), (da32, da) = f32(rng, B, L, C), f32(rng, C, K), f32(rng, C), f32(rng, B, L, C)
    gx, gw, gb = rt.from_numpy(x32), rt.from_numpy(w32), rt.from_numpy(b32)
    assert rel(conv1d.conv1d_silu(gx, gw, gb).numpy(), ref_conv.conv1d_silu(x, w, b)) < ELEMENTWISE_TOL
    dx, dw, db = conv1d.conv1d_silu_backward(gx, gw, gb, rt.from_numpy(da32))
    rdx, rdw, rdb = ref_conv.conv1d_silu_backward(x, w, b, da)
    assert rel(dx.numpy(), rdx) < REDUCTION_TOL
    assert rel(dw.numpy(), rdw) < REDUCTION_TOL
    assert rel(db.numpy(), rdb) < REDUCTION_TOL
