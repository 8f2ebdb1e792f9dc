"""GPU Mamba-3 SISO fold (mambactl/ops/mamba3_fold.py) against the float64 reference (mambactl/reference/mamba3.py's
mamba3_fold_scale / mamba3_fold_output / mamba3_fold_backward, which tests/test_reference_mamba3.py checks against
finite differences and against the scan). Outputs are poisoned by the fixture."""

import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.ops.mamba3_fold import FOLD_LANES, mamba3_fold_backward, mamba3_fold_output, mamba3_fold_scale
from mambactl.reference import mamba3 as ref


def make_inputs(batch, length, heads, nstate, headdim, lam_mode="random", seed=0):
    rng = np.random.default_rng(seed)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    lam = rng.random((batch, length, heads))
    if lam_mode == "near0":
        lam = 1e-6 * lam
    elif lam_mode == "near1":
        lam = 1 - 1e-6 * lam
    x = dict(q=rng.standard_normal((batch, length, heads, nstate)), k=rng.standard_normal((batch, length, heads, nstate)),
             v=rng.standard_normal((batch, length, heads, headdim)), dt=0.1 + rng.random((batch, length, heads)),
             lam=lam, y_core=rng.standard_normal((batch, length, heads, headdim)),
             dy=rng.standard_normal((batch, length, heads, headdim)),
             dq=rng.standard_normal((batch, length, heads, nstate)), dk=rng.standard_normal((batch, length, heads, nstate)),
             dv=rng.standard_normal((batch, length, heads, headdim)), dscale=rng.standard_normal((batch, length, heads)))
    return {name: f32(a) for name, a in x.items()}


def rel_err(got, want):
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("lanes", [1, 8, 64])  # CPU adapters, several rows per workgroup with a sum, GPUs
@pytest.mark.parametrize("batch,length,heads,nstate,headdim,lam_mode", [
    (1, 1, 1, 4, 3, "random"),     # one step: δ_{t+1} = 0 everywhere
    (3, 5, 2, 8, 4, "random"),     # several batch rows: the t+1 shift must not cross them
    (2, 7, 3, 70, 130, "random"),  # N, P past FOLD_LANES and not multiples of it
    (2, 6, 2, 16, 8, "near0"),     # λ ≈ 0: δ ≈ Δ, the correction is as large as the core's own term
    (2, 6, 2, 16, 8, "near1"),     # λ ≈ 1: δ ≈ 0 (Mamba-2)
    (1, 9, 24, 128, 64, "random"), # the 130m head
])
def test_matches_reference(gpu, batch, length, heads, nstate, headdim, lam_mode, lanes):
    """Each lane count on any adapter (rows B·L·H = 1, 30, 42, ...: the last workgroup partly past the end)."""
    x = make_inputs(batch, length, heads, nstate, headdim, lam_mode)
    x64 = {name: a.astype(np.float64) for name, a in x.items()}
    t = {name: gpu.from_numpy(a) for name, a in x.items()}
    scale = mamba3_fold_scale(t["dt"], t["lam"]).numpy()
    assert rel_err(scale, ref.mamba3_fold_scale(x64["dt"], x64["lam"])) < 1e-6
    y = mamba3_fold_output(t["y_core"], t["q"], t["k"], t["v"], t["dt"], t["lam"], lanes=lanes).numpy()
    want = ref.mamba3_fold_output(x64["y_core"], x64["q"], x64["k"], x64["v"], x64["dt"], x64["lam"])
    assert rel_err(y, want) < 1e-5, rel_err(y, want)
    names = ("q", "k", "v", "dt", "lam", "dy", "dq", "dk", "dv", "dscale")
    grads = mamba3_fold_backward(*(t[n] for n in names), lanes=lanes)
    grads_ref = ref.mamba3_fold_backward(*(x64[n] for n in names))
    for name, got, want in zip(("dq", "dk", "dv", "ddt", "dlam"), grads, grads_ref):
        got = got.numpy()
        assert got.shape == want.shape, name
        assert rel_err(got, want) < 1e-5, (name, rel_err(got, want))
    assert grads[0] is t["dq"] and grads[2] is t["dv"]  # corrected in place


def test_deterministic(gpu):
    x = make_inputs(2, 9, 3, 70, 70, seed=3)
    names = ("q", "k", "v", "dt", "lam", "dy", "dq", "dk", "dv", "dscale")
    runs = []
    for _ in range(2):
        t = {name: gpu.from_numpy(a) for name, a in x.items()}
        y = mamba3_fold_output(t["y_core"], t["q"], t["k"], t["v"], t["dt"], t["lam"]).numpy()
        runs.append([y] + [g.numpy() for g in mamba3_fold_backward(*(t[n] for n in names))])
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


def test_shape_errors(gpu):
    x = {name: gpu.from_numpy(a) for name, a in make_inputs(1, 4, 2, 3, 2).items()}
    with pytest.raises(ShapeError, match="mamba3_fold_scale: lam has shape"):
        mamba3_fold_scale(x["dt"], gpu.from_numpy(np.ones((1, 4, 3), np.float32)))
    with pytest.raises(ShapeError, match="mamba3_fold_output: k has shape"):
        mamba3_fold_output(x["y_core"], x["q"], gpu.from_numpy(np.ones((1, 4, 2, 5), np.float32)), x["v"], x["dt"],
                           x["lam"])
    with pytest.raises(ShapeError, match="mamba3_fold_output: y_core has shape"):
        mamba3_fold_output(x["q"], x["q"], x["k"], x["v"], x["dt"], x["lam"])
    with pytest.raises(ShapeError, match="mamba3_fold_backward: dscale has shape"):
        mamba3_fold_backward(x["q"], x["k"], x["v"], x["dt"], x["lam"], x["dy"], x["dq"], x["dk"], x["dv"], x["v"])
    with pytest.raises(ShapeError, match="lanes per row must divide"):
        mamba3_fold_output(x["y_core"], x["q"], x["k"], x["v"], x["dt"], x["lam"], lanes=3)
    assert FOLD_LANES == 64
