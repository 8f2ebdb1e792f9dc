"""The float64 Mamba-1 reference: hand-written backward vs central finite differences on every element (rel. < 1e-6)."""

import numpy as np
import pytest
from gradcheck import check_grad

from mambactl.models.config import Mamba1Config, ModelConfig
from mambactl.models.params import init_parameters, parameter_specs
from mambactl.reference.lm import lm_backward, lm_forward
from mambactl.reference.selective_scan import selective_scan, selective_scan_backward, selective_scan_step

TOL = 1e-6


def tiny_config(**mamba1):
    m = dict(d_state=3, d_conv=3, dt_rank=2) | mamba1
    return ModelConfig(vocab_size=11, d_model=6, n_layer=2, pad_vocab_size_multiple=8, mamba1=Mamba1Config(**m))


def random_params(cfg, seed=0):
    """mamba_ssm's init plus noise on every tensor, so no gradient hides behind a 0 or a 1.

    dt_proj.bias ~ N(0, 1) (Δ ≈ 0.7 instead of the init's ~0.01), so the scan carries real signal.
    """
    rng = np.random.default_rng(seed)
    params = {k: v.astype(np.float64) for k, v in init_parameters(cfg, seed).items()}
    for k, v in params.items():
        v += rng.normal(0.0, 0.5 if k.endswith("x_proj.weight") else 0.3, v.shape)
        if k.endswith("dt_proj.bias"):
            v[...] = rng.normal(0.0, 1.0, v.shape)
    return params


def scan_inputs(rng, Bsz=2, L=6, D=4, N=3):
    u, z = rng.normal(size=(Bsz, L, D)), rng.normal(size=(Bsz, L, D))
    delta = np.log1p(np.exp(rng.normal(size=(Bsz, L, D))))
    A = -np.exp(rng.normal(size=(D, N)) * 0.5)
    B, C = rng.normal(size=(Bsz, L, N)), rng.normal(size=(Bsz, L, N))
    return u, delta, A, B, C, rng.normal(size=D), z


@pytest.mark.parametrize("gated", [True, False])
def test_selective_scan_backward(gated):
    rng = np.random.default_rng(1)
    u, delta, A, B, C, D, z = scan_inputs(rng)
    z = z if gated else None
    dy = rng.normal(size=u.shape)
    grads = selective_scan_backward(u, delta, A, B, C, D, z, dy)
    f = lambda: np.sum(selective_scan(u, delta, A, B, C, D, z) * dy)
    for x, g in zip((u, delta, A, B, C, D, z), grads):
        assert (x is None) == (g is None)
        if x is not None:
            assert check_grad(f, x, g) < TOL


def test_selective_scan_matches_loop_and_step():
    """The scan equals the textbook recurrence (Euler B̄ = Δ B), and decoding step by step gives the same y."""
    rng = np.random.default_rng(2)
    u, delta, A, B, C, D, z = scan_inputs(rng)
    y = selective_scan(u, delta, A, B, C, D, z)
    b, d = 1, 2
    h, want = np.zeros(A.shape[1]), []
    for t in range(u.shape[1]):
        h = np.exp(delta[b, t, d] * A[d]) * h + delta[b, t, d] * B[b, t] * u[b, t, d]
        want.append((C[b, t] @ h + D[d] * u[b, t, d]) * z[b, t, d] / (1 + np.exp(-z[b, t, d])))
    assert np.allclose(y[b, :, d], want, rtol=1e-13, atol=0)
    state = np.zeros((u.shape[0], u.shape[2], A.shape[1]))
    for t in range(u.shape[1]):
        y_t, state = selective_scan_step(state, u[:, t], delta[:, t], A, B[:, t], C[:, t], D, z[:, t])
        assert np.allclose(y_t, y[:, t], rtol=1e-13, atol=0)


@pytest.mark.parametrize("bias", [False, True], ids=["default", "with_biases"])
def test_lm_gradients_every_parameter(bias):
    cfg = tiny_config(bias=bias, conv_bias=True)
    params = random_params(cfg)
    assert set(params) == {s.name for s in parameter_specs(cfg)}
    rng = np.random.default_rng(3)
    ids = rng.integers(0, cfg.vocab_size, size=(2, 5))
    targets = np.concatenate([ids[:, 1:], np.full((2, 1), -100)], axis=1)
    logits, loss, saved = lm_forward(params, cfg, ids, targets)
    assert logits.shape == (2, 5, cfg.padded_vocab_size) and np.isfinite(loss)
    grads = lm_backward(params, cfg, saved)
    assert set(grads) == set(params)
    f = lambda: lm_forward(params, cfg, ids, targets)[1]
    errors = {k: check_grad(f, params[k], grads[k]) for k in params}
    assert max(errors.values()) < TOL, errors


def test_lm_without_conv_bias_length_one():
    cfg = tiny_config(conv_bias=False)
    params = random_params(cfg)
    assert "backbone.layers.0.mixer.conv1d.bias" not in params
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, size=(3, 1))
    _, loss, saved = lm_forward(params, cfg, ids, ids)
    grads = lm_backward(params, cfg, saved)
    assert set(grads) == set(params)
    f = lambda: lm_forward(params, cfg, ids, ids)[1]
    assert max(check_grad(f, params[k], grads[k]) for k in params) < TOL
