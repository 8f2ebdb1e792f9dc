"""The AdamW reference against a scalar textbook loop and torch.optim.AdamW; guard, trust region, clip scale."""

import math

import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.reference.adamw import adamw_step, clip_scale

HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


def textbook(param, grads, *, lr, beta1, beta2, eps, weight_decay):
    """Element by element with Python floats: Loshchilov & Hutter's AdamW with Adam's bias correction."""
    out = []
    for i, p in enumerate(param.ravel().tolist()):
        m = v = 0.0
        for t, grad in enumerate(grads, start=1):
            g = float(grad.ravel()[i])
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            p = p - lr * weight_decay * p - lr * (m / (1 - beta1**t)) / (math.sqrt(v / (1 - beta2**t)) + eps)
        out.append(p)
    return np.array(out).reshape(param.shape)


def run(param, grads, **kw):
    m, v, n_bad = np.zeros_like(param), np.zeros_like(param), 0
    for t, g in enumerate(grads, start=1):
        param, m, v, bad = adamw_step(param, g, m, v, step=t, **{**HP, **kw})
        n_bad += bad
    return param, m, v, n_bad


def test_matches_the_textbook_formula():
    rng = np.random.default_rng(0)
    param = rng.normal(size=(3, 4))
    grads = [rng.normal(size=(3, 4)) for _ in range(6)]
    got, _, _, n_bad = run(param, grads)
    np.testing.assert_allclose(got, textbook(param, grads, **HP), rtol=1e-13, atol=1e-15)
    assert n_bad == 0


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95)])
def test_matches_torch_adamw(weight_decay, betas):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    param = rng.normal(size=(5, 7))
    grads = [rng.normal(scale=10.0 ** rng.integers(-3, 2), size=(5, 7)) for _ in range(8)]
    hp = dict(lr=3e-2, beta1=betas[0], beta2=betas[1], eps=1e-8, weight_decay=weight_decay)

    t_param = torch.tensor(param, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW([t_param], lr=hp["lr"], betas=betas, eps=hp["eps"], weight_decay=weight_decay)
    for g in grads:
        t_param.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    state = opt.state[t_param]

    got, m, v, _ = run(param, grads, **hp)
    np.testing.assert_allclose(got, t_param.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(m, state["exp_avg"].numpy(), rtol=1e-12)
    np.testing.assert_allclose(v, state["exp_avg_sq"].numpy(), rtol=1e-12)


def test_first_step_is_bias_corrected():
    # at t = 1, m̂ = g and v̂ = g², so the step is lr·g/(|g| + eps) ≈ lr·sign(g)
    param, grad = np.zeros(3), np.array([-4.0, 1e-2, 2.0])
    new, _, _, _ = adamw_step(param, grad, np.zeros(3), np.zeros(3), step=1, **HP)
    np.testing.assert_allclose(new, -HP["lr"] * np.sign(grad), rtol=1e-5)


def test_grad_scale_multiplies_the_gradient_first():
    rng = np.random.default_rng(2)
    p, g, m, v = rng.normal(size=(4, 10))
    v = np.abs(v)
    scaled = adamw_step(p, g, m, v, step=3, grad_scale=0.25, **HP)
    direct = adamw_step(p, 0.25 * g, m, v, step=3, **HP)
    for a, b in zip(scaled, direct):
        np.testing.assert_array_equal(a, b)


def test_inputs_are_not_mutated():
    rng = np.random.default_rng(3)
    arrays = [rng.normal(size=6) for _ in range(4)]
    arrays[3] = np.abs(arrays[3])
    copies = [a.copy() for a in arrays]
    adamw_step(*arrays, step=2, **HP)
    for a, c in zip(arrays, copies):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e200])  # 1e200: finite, but g² overflows v
def test_guard_leaves_weight_and_moments_unchanged(bad):
    rng = np.random.default_rng(4)
    p, m = rng.normal(size=(2, 8))
    v = np.abs(rng.normal(size=8))
    g = rng.normal(size=8)
    g[[1, 5]] = bad
    new_p, new_m, new_v, n_bad = adamw_step(p, g, m, v, step=5, **HP)
    assert n_bad == 2
    for new, old in ((new_p, p), (new_m, m), (new_v, v)):
        np.testing.assert_array_equal(new[[1, 5]], old[[1, 5]])
    good = [0, 2, 3, 4, 6, 7]
    ref = adamw_step(p[good], g[good], m[good], v[good], step=5, **HP)
    for new, expected in zip((new_p, new_m, new_v), ref):
        np.testing.assert_array_equal(new[good], expected)
    assert all(np.isfinite(a).all() for a in (new_p, new_m, new_v))


def test_guard_catches_a_scale_that_makes_the_gradient_non_finite():
    p, g, m, v = np.ones(3), np.array([1.0, 1e300, 2.0]), np.zeros(3), np.zeros(3)
    new_p, _, _, n_bad = adamw_step(p, g, m, v, step=1, grad_scale=1e10, **HP)
    assert n_bad == 1 and new_p[1] == 1.0


def test_trust_region_clamps_each_step():
    rng = np.random.default_rng(5)
    p, g = rng.normal(size=(2, 50))
    m, v = np.zeros(50), np.zeros(50)
    hp = {**HP, "lr": 0.5, "weight_decay": 0.0}
    free, _, _, _ = adamw_step(p, g, m, v, step=1, **hp)
    clamped, m1, v1, _ = adamw_step(p, g, m, v, step=1, max_delta=0.1, **hp)
    assert np.abs(p - free).max() > 0.4  # unclamped: |step| ≈ lr
    np.testing.assert_allclose(np.abs(p - clamped), 0.1)
    np.testing.assert_array_equal(np.sign(p - clamped), np.sign(p - free))
    small = adamw_step(p, g, m, v, step=1, max_delta=1.0, **hp)[0]  # bound above every step: no effect
    np.testing.assert_array_equal(small, free)
    _, m_free, v_free, _ = adamw_step(p, g, m, v, step=1, **hp)
    np.testing.assert_array_equal(m1, m_free)  # the moments are not clamped
    np.testing.assert_array_equal(v1, v_free)


def test_trust_region_does_not_clamp_decay():
    p, g, z = np.array([10.0]), np.array([1.0]), np.zeros(1)
    new, _, _, _ = adamw_step(p, g, z, z, step=1, lr=0.5, beta1=0.9, beta2=0.99, eps=0.0, weight_decay=0.1,
                              max_delta=0.01)
    np.testing.assert_allclose(new, 10.0 * (1 - 0.05) - 0.01)


def test_shape_mismatch_and_step_zero():
    with pytest.raises(ShapeError):
        adamw_step(np.zeros(3), np.zeros(4), np.zeros(3), np.zeros(3), step=1, **HP)
    with pytest.raises(ValueError):
        adamw_step(np.zeros(3), np.zeros(3), np.zeros(3), np.zeros(3), step=0, **HP)


def test_clip_scale():
    assert clip_scale(0.5, 1.0) == 1.0
    assert clip_scale(1.0, 1.0) == 1.0
    assert clip_scale(4.0, 1.0) == 0.25
    assert clip_scale(0.0, 1.0) == 1.0
    assert clip_scale(1e9, 0.0) == 1.0  # clipping disabled
    with pytest.raises(ValueError):
        clip_scale(math.nan, 1.0)
    with pytest.raises(ValueError):
        clip_scale(math.inf, 1.0)


def test_clip_scale_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    grads = [rng.normal(size=s) for s in ((3, 4), (5,), (2, 2, 2))]
    tensors = [torch.zeros(g.shape, dtype=torch.float64, requires_grad=True) for g in grads]
    for t, g in zip(tensors, grads):
        t.grad = torch.tensor(g)
    norm = float(torch.nn.utils.clip_grad_norm_(tensors, max_norm=1.0))
    scale = clip_scale(math.sqrt(sum(float(np.sum(g * g)) for g in grads)), 1.0)
    assert norm == pytest.approx(math.sqrt(sum(float(np.sum(g * g)) for g in grads)), rel=1e-12)
    for t, g in zip(tensors, grads):
        np.testing.assert_allclose(t.grad.numpy(), g * scale, rtol=1e-6)
