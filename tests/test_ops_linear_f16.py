"""The f16 GEMM (matmul_f16, `precision="f16"`) against the float64 reference, at the error bound derived from
its arithmetic (ops.linear.f16_error_bound: f16 rounding of each operand and of every product and partial sum of
at most FLUSH terms, f32 sums of the flushes) — a bound, not a tolerance fitted to the results. Random non-zero
data, NaN-poisoned outputs, ragged shapes, every transpose, split-K, bias and accumulation; gradient-sized
operands (~1e-8, where unscaled f16 would flush to zero) and large ones (where unscaled f16 would overflow)."""


import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.ops import linear
from mambactl.runtime.gpu import get_runtime

pytestmark = pytest.mark.skipif("shader-f16" not in get_runtime().features, reason="the adapter lacks shader-f16")


def data(rng, *shape, scale=1.0):
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    assert np.count_nonzero(x) == x.size
    return x


def check(got, ref, bound):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), "unwritten (NaN-poisoned) or non-finite elements in the output"
    assert np.abs(ref).max() > 0
    err = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst} (ref {ref[worst]:.3g})"


def operands(rng, M, K, N, ta, tb, scale_a=1.0, scale_b=1.0):
    a32 = data(rng, *((K, M) if ta else (M, K)), scale=scale_a)
    b32 = data(rng, *((N, K) if tb else (K, N)), scale=scale_b)
    a = a32.astype(np.float64).T if ta else a32.astype(np.float64)
    b = b32.astype(np.float64).T if tb else b32.astype(np.float64)
    return a32, b32, a, b


F32_ADD = linear.F32_ROUNDING  # one f32 rounding of the bias or accumulator add

# ragged (scalar loads) and multiple-of-4 shapes (vec4 loads), edge tiles, K past one tile, split-K
SHAPES = [(1, 5, 3, 1), (65, 17, 130, 1), (130, 300, 7, 3), (132, 100, 260, 1), (36, 1040, 12, 3)]


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("M,K,N,split_k", SHAPES)
def test_matmul_f16_within_its_error_bound(rt, rng, ta, tb, M, K, N, split_k):
    a32, b32, a, b = operands(rng, M, K, N, ta, tb, scale_b=0.05)
    ref = a @ b
    bound = linear.f16_error_bound(a, b)
    # split-K: each plane is within its own bound (they add up to at most the whole-K one), and the planes'
    # f32 sum rounds split_k - 1 times, relative to at most Σ|a||b| (+ the planes' errors) each
    planes = F32_ADD * (split_k - 1) * (np.abs(a) @ np.abs(b) + bound)
    ga, gb = rt.from_numpy(a32), rt.from_numpy(b32)
    kw = dict(trans_a=ta, trans_b=tb, precision="f16")
    check(linear.matmul(ga, gb, split_k=split_k, **kw).numpy(), ref, bound + planes)
    acc32 = data(rng, M, N)
    out = rt.from_numpy(acc32)
    linear.matmul(ga, gb, out=out, split_k=split_k, **kw)
    acc = acc32.astype(np.float64)
    check(out.numpy(), acc + ref, bound + planes + F32_ADD * (np.abs(acc) + np.abs(a) @ np.abs(b) + bound))
    if split_k == 1:
        bias32 = data(rng, N)
        bias = bias32.astype(np.float64)
        got = linear.matmul(ga, gb, bias=rt.from_numpy(bias32), **kw).numpy()
        check(got, ref + bias, bound + F32_ADD * (np.abs(bias) + np.abs(ref) + bound))


@pytest.mark.parametrize("tile", sorted(linear.TILES))
@pytest.mark.parametrize("flush,subtiles", [(8, 1), (16, 1), (32, 1), (64, 1), (8, 2), (16, 2), (32, 2), (64, 2)])
@pytest.mark.parametrize("M,K,N,ta", [(70, 520, 36, False), (128, 96, 132, True)])
def test_matmul_f16_every_tile_flush_length_and_k_tile(rt, rng, tile, flush, subtiles, M, K, N, ta):
    a32, b32, a, b = operands(rng, M, K, N, ta, True)
    got = linear.matmul(rt.from_numpy(a32), rt.from_numpy(b32), trans_a=ta, trans_b=True, precision="f16",
                        tile=tile, kernel="matmul_f16", flush=flush, subtiles=subtiles).numpy()
    check(got, a @ b, linear.f16_error_bound(a, b, flush))


def test_matmul_f16_rounds_to_f16(rt, rng):
    """The f16 mode really computes in f16: its error is above what fp32 would make, though within its bound."""
    a32, b32, a, b = operands(rng, 64, 256, 64, False, False)
    got = linear.matmul(rt.from_numpy(a32), rt.from_numpy(b32), precision="f16").numpy()
    err = np.abs(got - a @ b)
    fp32_scale = linear.F32_ROUNDING * (np.abs(a) @ np.abs(b))
    assert err.max() > 16 * fp32_scale.max()


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False)])  # dX = dy w, dW = dyᵀ x
def test_gradient_sized_operands_keep_their_digits(rt, rng, ta, tb):
    """dy ~ 1e-8 (the model's gradients are 1e-6..1e-9): unscaled f16 would flush most of it to zero or to a
    few subnormal digits — the same bound then fails by orders of magnitude (shown on the host with numpy's
    f16: most elements break it even with exact products). The kernel's power-of-two scales keep the bound."""
    M, K, N = 96, 200, 80
    a32, b32, a, b = operands(rng, M, K, N, ta, tb, scale_a=1e-8)
    ref = a @ b
    bound = linear.f16_error_bound(a, b)
    got = linear.matmul(rt.from_numpy(a32), rt.from_numpy(b32), trans_a=ta, trans_b=tb, precision="f16").numpy()
    check(got, ref, bound)
    unscaled = a.astype(np.float16).astype(np.float64) @ b.astype(np.float16).astype(np.float64)
    assert np.mean(np.abs(unscaled - ref) > bound) > 0.5


def test_large_operands_do_not_overflow(rt, rng):
    """Values of 1e5 and 1e3 (past f16's 65504, products ~1e8): scaled down, so nothing overflows."""
    a32, b32, a, b = operands(rng, 64, 128, 64, False, True, scale_a=1e5, scale_b=1e3)
    got = linear.matmul(rt.from_numpy(a32), rt.from_numpy(b32), trans_b=True, precision="f16").numpy()
    check(got, a @ b, linear.f16_error_bound(a, b))
    with np.errstate(over="ignore"):
        assert not np.all(np.isfinite(a.astype(np.float16)))  # unscaled, the operands alone would be inf


def test_linear_backward_in_f16_mode(rt, rng):
    """The runtime's matmul_precision reaches linear/linear_backward (dy's amax shared by dX and dW)."""
    M, K, N = 130, 136, 132
    x32, w32, dy32 = data(rng, M, K), data(rng, N, K, scale=0.05), data(rng, M, N, scale=1e-7)
    x, w, dy = (t.astype(np.float64) for t in (x32, w32, dy32))
    gx, gw, gdy = rt.from_numpy(x32), rt.from_numpy(w32), rt.from_numpy(dy32)
    rt.matmul_precision = "f16"
    rt.gpu_times = []
    try:
        y = linear.linear(gx, gw).numpy()
        dx, dw, _ = linear.linear_backward(gx, gw, gdy)
        dx, dw = dx.numpy(), dw.numpy()
        entries = [e for e, _, _ in rt.gpu_times]
    finally:
        rt.matmul_precision = "fp32"
        rt.gpu_times = None
    check(y, x @ w.T, linear.f16_error_bound(x, w.T))
    check(dx, dy @ w, linear.f16_error_bound(dy, w))
    check(dw, dy.T @ x, linear.f16_error_bound(dy.T, x))
    if "timestamp-query" in rt.features:
        assert entries.count("matmul_f16") == 3 and "matmul" not in entries and "matmul_direct" not in entries
        assert entries.count("operand_amax") == 2 + 3  # x, w; then dy once, w, x


@pytest.mark.parametrize("n", [1, 3, 4, 1001, 70000])
def test_operand_amax(rt, rng, n):
    x32 = data(rng, n)
    got = linear.operand_amax(rt.from_numpy(x32)).numpy()
    assert got.view(np.float32)[0] == np.abs(x32).max()
    x32[n // 2] = np.nan
    assert linear.operand_amax(rt.from_numpy(x32)).numpy()[0] >= 0x7F800000  # NaN: the scale is turned off


def test_bad_precision_and_flush_are_shape_errors(rt):
    a = rt.from_numpy(np.ones((4, 4), np.float32))
    with pytest.raises(ShapeError, match="matmul: unknown precision 'bf16'"):
        linear.matmul(a, a, precision="bf16")
    with pytest.raises(ShapeError, match="matmul: flush must be a power of two >= 8"):
        linear.matmul(a, a, precision="f16", flush=48)
    with pytest.raises(ShapeError, match="matmul: subtiles must be 1 or 2"):
        linear.matmul(a, a, precision="f16", subtiles=4)
    with pytest.raises(ShapeError, match="matmul: precision f16 runs matmul_f16"):
        linear.matmul(a, a, precision="f16", kernel="matmul")


def test_operand_exponent_keeps_partial_sums_finite():
    for flush in (8, 16, 32, 64, 128):
        e = linear.operand_exponent(flush)
        assert flush * 2.0 ** (2 * e) <= 2.0 ** 15 < flush * 2.0 ** (2 * e + 2)
