"""GPU gated grouped RMSNorm (mambactl/ops/rmsnorm_gated.py) against the float64 reference."""

import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.ops.rmsnorm_gated import rmsnorm_gated, rmsnorm_gated_backward
from mambactl.reference import rmsnorm_gated as ref


def rel(got, want):
    assert np.all(np.isfinite(got))
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def inputs(M, D, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in ((M, D), (M, D), (D,), (M, D))]


@pytest.mark.parametrize("M,D,group", [
    (1, 8, 8),
    (5, 12, 4),      # three groups per row
    (300, 40, 20),   # more rows than one weight-gradient slice
    (7, 130, 65),    # groups wider than the 64-thread workgroup
])
@pytest.mark.parametrize("columns", [False, True], ids=["dense", "columns"])
@pytest.mark.parametrize("rows_path", [False, True], ids=["workgroup_per_row", "invocation_per_row"])
def test_matches_reference(rt, M, D, group, columns, rows_path):
    """Row counts leaving a ragged last block of the backward's 8-row blocks; with `columns` z is read from columns
    [3, 3 + D) of a wider matrix and dz written into columns [1, 1 + D) of another (the rest left as it was).
    Both kernels: a workgroup per (row, group) with a tree sum (GPUs), an invocation per (row, group) (CPUs)."""
    y, z, w, dout = inputs(M, D)
    gy, gw = rt.from_numpy(y), rt.from_numpy(w)
    rng = np.random.default_rng(3)
    if columns:
        wide = rng.standard_normal((M, D + 5)).astype(np.float32)
        wide[:, 3:3 + D] = z
        gz, kw = rt.from_numpy(wide), dict(z_start=3)
        dz_wide = rng.standard_normal((M, D + 2)).astype(np.float32)
        kw_dz = dict(dz_out=(rt.from_numpy(dz_wide), 1))
    else:
        gz, kw, kw_dz = rt.from_numpy(z), {}, {}
    kw["rows_path"] = rows_path
    out, rstd = rmsnorm_gated(gy, gz, gw, group, 1e-5, **kw)
    dy, dz, dw = rmsnorm_gated_backward(gy, gz, gw, rstd, group, rt.from_numpy(dout), **kw, **kw_dz)
    dz = dz.numpy()
    if columns:
        np.testing.assert_array_equal(np.delete(dz, range(1, 1 + D), axis=1), np.delete(dz_wide, range(1, 1 + D), axis=1))
        dz = dz[:, 1:1 + D]
    f64 = [a.astype(np.float64) for a in (y, z, w, dout)]
    assert rel(out.numpy(), ref.rmsnorm_gated(*f64[:3], group, 1e-5)) < 1e-5
    want = ref.rmsnorm_gated_backward(*f64[:3], group, f64[3], 1e-5)
    for name, got, exp in zip(("dy", "dz", "dw"), (dy.numpy(), dz, dw.numpy()), want):
        assert rel(got, exp) < 1e-5, name
    assert rstd.shape == (M, D // group)


@pytest.mark.parametrize("rows_path", [False, True], ids=["workgroup_per_row", "invocation_per_row"])
def test_weight_grad_accumulates_deterministically(rt, rows_path):
    """1100 rows: the per-row backward then takes 2 rows an invocation (ops.rmsnorm.rows_block), a ragged last."""
    y, z, w, dout = inputs(1100, 24, seed=1)
    args = [rt.from_numpy(a) for a in (y, z, w)]
    _, rstd = rmsnorm_gated(*args, 6, rows_path=rows_path)
    _, _, fresh = rmsnorm_gated_backward(*args, rstd, 6, rt.from_numpy(dout), rows_path=rows_path)
    _, _, again = rmsnorm_gated_backward(*args, rstd, 6, rt.from_numpy(dout), rows_path=rows_path)
    assert np.array_equal(fresh.numpy(), again.numpy())
    want = ref.rmsnorm_gated_backward(*(a.astype(np.float64) for a in (y, z, w)), 6, dout.astype(np.float64), 1e-5)[2]
    assert rel(fresh.numpy(), want) < 1e-5
    start = np.random.default_rng(2).standard_normal(24).astype(np.float32)
    acc = rt.from_numpy(start)
    rmsnorm_gated_backward(*args, rstd, 6, rt.from_numpy(dout), dw=acc, rows_path=rows_path)
    np.testing.assert_allclose(acc.numpy(), start + fresh.numpy(), rtol=1e-6, atol=1e-6)


def test_shape_errors(rt):
    y, z, w, _ = (rt.from_numpy(a) for a in inputs(2, 12))
    with pytest.raises(ShapeError, match="group_size 5"):
        rmsnorm_gated(y, z, w, 5)
    with pytest.raises(ShapeError, match="z columns"):
        rmsnorm_gated(y, rt.from_numpy(np.zeros((2, 8), np.float32)), w, 4)
    with pytest.raises(ShapeError, match="z has shape"):
        rmsnorm_gated(y, rt.from_numpy(np.zeros((3, 12), np.float32)), w, 4)
