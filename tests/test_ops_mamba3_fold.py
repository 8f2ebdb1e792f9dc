"""GPU Mamba-3 SISO fold (mambactl/ops/mamba3_fold.py) against the float64 reference (mambactl/reference/mamba3.py's
mamba3_fold_scale / mamba3_fold_backward, which tests/test_reference_mamba3.py checks against finite differences
and, composed with the SSD core, against the scan). Outputs are poisoned by the fixture."""

import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.ops.mamba3_fold import mamba3_fold_backward, mamba3_fold_scale
from mambactl.reference import mamba3 as ref


def make_inputs(batch, length, heads, lam_mode="random", seed=0):
    rng = np.random.default_rng(seed)
    lam = rng.random((batch, length, heads))
    if lam_mode == "near0":
        lam = 1e-6 * lam
    elif lam_mode == "near1":
        lam = 1 - 1e-6 * lam
    x = dict(dt=0.1 + rng.random((batch, length, heads)), lam=lam, dscale=rng.standard_normal((batch, length, heads)),
             ddiag=rng.standard_normal((batch, length, heads)))
    return {name: np.asarray(a, np.float32) for name, a in x.items()}


def rel_err(got, want):
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("batch,length,heads,lam_mode", [
    (1, 1, 1, "random"),     # one step: δ_{t+1} = 0 everywhere
    (3, 5, 2, "random"),     # several batch rows: the t+1 shift must not cross them
    (2, 6, 2, "near0"),      # λ ≈ 0: δ ≈ Δ
    (2, 6, 2, "near1"),      # λ ≈ 1: δ ≈ 0 (Mamba-2)
    (2, 300, 24, "random"),  # the 130m heads; several workgroups, the last partly past the end
])
def test_matches_reference(gpu, batch, length, heads, lam_mode):
    x = make_inputs(batch, length, heads, lam_mode)
    x64 = {name: a.astype(np.float64) for name, a in x.items()}
    t = {name: gpu.from_numpy(a) for name, a in x.items()}
    for name, got, want in zip(("scale", "diag"), mamba3_fold_scale(t["dt"], t["lam"]),
                               ref.mamba3_fold_scale(x64["dt"], x64["lam"])):
        assert rel_err(got.numpy(), want) < 1e-6, name
    grads = mamba3_fold_backward(t["dt"], t["lam"], t["dscale"], t["ddiag"])
    grads_ref = ref.mamba3_fold_backward(x64["dt"], x64["lam"], x64["dscale"], x64["ddiag"])
    for name, got, want in zip(("ddt", "dlam"), grads, grads_ref):
        got = got.numpy()
        assert got.shape == want.shape, name
        assert rel_err(got, want) < 1e-6, (name, rel_err(got, want))


def test_shape_errors(gpu):
    x = {name: gpu.from_numpy(a) for name, a in make_inputs(1, 4, 2).items()}
    with pytest.raises(ShapeError, match="mamba3_fold_scale: lam has shape"):
        mamba3_fold_scale(x["dt"], gpu.from_numpy(np.ones((1, 4, 3), np.float32)))
    with pytest.raises(ShapeError, match="mamba3_fold_backward: dscale has shape"):
        mamba3_fold_backward(x["dt"], x["lam"], gpu.from_numpy(np.ones((1, 4, 3), np.float32)), x["ddiag"])
    with pytest.raises(ShapeError, match="mamba3_fold_backward: ddiag has shape"):
        mamba3_fold_backward(x["dt"], x["lam"], x["dscale"], gpu.from_numpy(np.ones((4, 2), np.float32)))
