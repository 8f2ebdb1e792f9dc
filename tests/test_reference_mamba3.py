"""The float64 Mamba-3 reference (SISO and MIMO): chunked scan == the step recurrence, hand-written backward vs
central finite differences on every element (rel. < 1e-6), and the Mamba3Config / parameter table it rests on."""

import json
import math

import numpy as np
import pytest
import gradcheck
from gradcheck import check_grad

from mambactl.errors import MambactlError
from mambactl.models.config import Mamba1Config, Mamba2Config, Mamba3Config, ModelConfig
from mambactl.models.params import init_parameters, parameter_specs
from mambactl.reference.lm import lm_forward
from mambactl.reference.mamba3 import (heavy_tail, heavy_tail_backward, mamba3_block, mamba3_fold_backward,
                                       mamba3_fold_scale, mamba3_init_cache, mamba3_scan,
                                       mamba3_scan_backward, mamba3_scan_sequential, mamba3_step, rope_pairs, rotate,
                                       rotate_backward)
from mambactl.reference.ssd import ssd_chunked, ssd_chunked_backward, ssd_sequential

TOL = 1e-6


def tiny_config(layers=("mamba3", "mamba3"), **mamba3):
    """d_model 4 -> d_inner 8 -> 2 heads of 4 channels, d_state 4; chunk 2 so that short sequences span chunks."""
    m = dict(d_state=4, headdim=4, chunk_size=2, mimo_rank=2) | mamba3
    return ModelConfig(vocab_size=11, d_model=4, n_layer=len(layers), layers=list(layers), pad_vocab_size_multiple=8,
                       mamba1=Mamba1Config(d_state=3, d_conv=3, dt_rank=2),
                       mamba2=Mamba2Config(d_state=3, d_conv=3, headdim=4, chunk_size=2), mamba3=Mamba3Config(**m))


def random_params(cfg, seed=0):
    """mamba_ssm's init plus noise on every tensor, so no gradient hides behind a 0 or a 1; dt biases ~ N(0, 1)
    (Δ ≈ 0.7 instead of the init's ~0.01) so the state carries real signal across chunks."""
    rng = np.random.default_rng(seed)
    params = {k: v.astype(np.float64) for k, v in init_parameters(cfg, seed).items()}
    for k, v in params.items():
        v += rng.normal(0.0, 0.5 if k.endswith(("x_proj.weight", "in_proj.weight")) else 0.3, v.shape)
        if k.endswith(("dt_proj.bias", "dt_bias")):
            v[...] = rng.normal(0.0, 1.0, v.shape)
        if k.endswith("A_log") and v.ndim == 1:
            v[...] = rng.normal(0.0, 0.5, v.shape)
    return params


def scan_inputs(rng, b=2, l=7, h=3, r=2, p=3, n=4):
    q, k = rng.normal(size=(b, l, h, r, n)), rng.normal(size=(b, l, h, r, n))
    v = rng.normal(size=(b, l, h, r, p))
    dt = np.log1p(np.exp(rng.normal(size=(b, l, h))))
    adt = -dt * np.exp(0.5 * rng.normal(size=(b, l, h)))
    lam = 1 / (1 + np.exp(-rng.normal(size=(b, l, h))))
    return q, k, v, adt, dt, lam


# --- the scan -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("r", [1, 3])
def test_scan_chunked_equals_sequential(r):
    rng = np.random.default_rng(1)
    for l in (1, 2, 5, 8, 13):
        inputs = scan_inputs(rng, l=l, r=r)
        want = mamba3_scan_sequential(*inputs)
        for chunk in (1, 2, 3, 4, 8, 16):
            got = mamba3_scan(*inputs, chunk)
            assert got.shape == want.shape
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err < 1e-10, (l, chunk, err)


def test_scan_is_the_trapezoidal_recurrence():
    """One (batch, head) by explicit loops: h_t = α h + β Σ_r v_{t−1,r} k_{t−1,r}ᵀ + γ Σ_r v_{t,r} k_{t,r}ᵀ."""
    rng = np.random.default_rng(2)
    q, k, v, adt, dt, lam = scan_inputs(rng, l=6)
    y = mamba3_scan(q, k, v, adt, dt, lam, 4)
    for b, hd in [(0, 0), (1, 2)]:
        h = np.zeros((v.shape[-1], q.shape[-1]))
        for t in range(q.shape[1]):
            alpha = math.exp(adt[b, t, hd])
            beta, gamma = (1 - lam[b, t, hd]) * dt[b, t, hd] * alpha, lam[b, t, hd] * dt[b, t, hd]
            h = alpha * h + gamma * sum(np.outer(v[b, t, hd, r], k[b, t, hd, r]) for r in range(v.shape[3]))
            if t:
                h += beta * sum(np.outer(v[b, t - 1, hd, r], k[b, t - 1, hd, r]) for r in range(v.shape[3]))
            for r in range(v.shape[3]):
                assert np.allclose(y[b, t, hd, r], h @ q[b, t, hd, r], rtol=1e-12, atol=1e-14)


def test_scan_lambda_one_is_mamba2():
    """λ = 1 is Mamba-2's exponential-Euler update: the SSD reference with x = v, B = k, C = q."""
    rng = np.random.default_rng(3)
    q, k, v, _, dt, _ = scan_inputs(rng, l=6, r=1)
    A = -np.exp(rng.normal(size=3) * 0.5)
    y = mamba3_scan(q, k, v, A * dt, dt, np.ones_like(dt), 4)
    want = ssd_sequential(v[:, :, :, 0], dt, A, k[:, :, :, 0], q[:, :, :, 0])
    assert np.allclose(y[:, :, :, 0], want, rtol=1e-12, atol=1e-13)


def test_scan_long_decay_stays_finite():
    """Strong decay over a long chunk (Σ A Δ ≈ -2000): exact zeros from the stable segsum, never inf - inf."""
    rng = np.random.default_rng(4)
    q, k, v, adt, dt, lam = scan_inputs(rng, l=40)
    adt = adt * 50
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow to 0 is the point
        y = mamba3_scan(q, k, v, adt, dt, lam, 32)
    assert np.allclose(y, mamba3_scan_sequential(q, k, v, adt, dt, lam), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("r,l,chunk", [(1, 5, 2), (2, 7, 3), (3, 4, 8)])
def test_scan_backward(r, l, chunk):
    rng = np.random.default_rng(5)
    inputs = scan_inputs(rng, l=l, r=r)
    dy = rng.normal(size=inputs[2].shape)
    grads = mamba3_scan_backward(*inputs, dy)
    f = lambda: np.sum(mamba3_scan(*inputs, chunk) * dy)
    for name, t, grad in zip("q k v adt dt lam".split(), inputs, grads):
        assert grad.shape == t.shape
        assert check_grad(f, t, grad, max_elems=60) < TOL, name


# --- the SISO fold into a Mamba-2 SSD ---------------------------------------------------------------------------


def _siso(q, k, v):
    return q[:, :, :, 0], k[:, :, :, 0], v[:, :, :, 0]


def test_fold_scale():
    """s_t = λ_t Δ_t + (1 − λ_{t+1}) Δ_{t+1} (0 after each sequence's last step, never across batch rows) and
    d_t = λ_t Δ_t, by a loop."""
    rng = np.random.default_rng(20)
    q, k, v, adt, dt, lam = scan_inputs(rng, b=2, l=5, r=1)
    s, d = mamba3_fold_scale(dt, lam)
    for b in range(2):
        for t in range(5):
            nxt = (1 - lam[b, t + 1]) * dt[b, t + 1] if t + 1 < 5 else 0.0
            np.testing.assert_allclose(s[b, t], lam[b, t] * dt[b, t] + nxt, rtol=1e-15)
            np.testing.assert_allclose(d[b, t], lam[b, t] * dt[b, t], rtol=1e-15)


@pytest.mark.parametrize("l", [1, 6])
def test_fold_backward(l):
    """The fold's adjoint against finite differences of Σ w·scale + Σ u·diag (w, u standing in for the core's
    ∂loss/∂scale and ∂loss/∂diag)."""
    rng = np.random.default_rng(21)
    _, _, _, _, dt, lam = scan_inputs(rng, b=2, l=l, r=1)
    w, u = rng.normal(size=dt.shape), rng.normal(size=dt.shape)
    grads = mamba3_fold_backward(dt, lam, w, u)

    def f():
        s, d = mamba3_fold_scale(dt, lam)
        return np.sum(s * w) + np.sum(d * u)
    for name, t, grad in zip(("dt", "lam"), (dt, lam), grads):
        assert grad.shape == t.shape
        assert check_grad(f, t, grad) < TOL, name


@pytest.mark.parametrize("lam_mode", ["random", "near0", "near1"])
@pytest.mark.parametrize("chunk", [4, 9])
def test_fold_composes_to_the_scan(lam_mode, chunk):
    """mamba3_scan (SISO) == the SSD core with x = v, B = k (one group per head), C = q, decay adt and
    (scale, diag) = fold_scale, and its backward == fold_backward after the core's backward
    (mambactl/reference/ssd.py's ssd_chunked / ssd_chunked_backward); ∂q, ∂k, ∂v, ∂adt are the core's."""
    rng = np.random.default_rng(22)
    q, k, v, adt, dt, lam = scan_inputs(rng, b=2, l=9, r=1)
    if lam_mode != "random":
        eps = 1e-6 * rng.random(lam.shape)
        lam = eps if lam_mode == "near0" else 1 - eps
    dy = rng.normal(size=v.shape)
    q1, k1, v1 = _siso(q, k, v)
    s, d = mamba3_fold_scale(dt, lam)
    y = ssd_chunked(v1, adt, s, k1, q1, chunk, diag=d)
    np.testing.assert_allclose(y, mamba3_scan_sequential(q, k, v, adt, dt, lam)[:, :, :, 0], rtol=1e-10,
                               atol=1e-12)
    dv, dadt, dscale, dk, dq, _, ddiag = ssd_chunked_backward(v1, adt, s, k1, q1, dy[:, :, :, 0], diag=d)
    ddt, dlam = mamba3_fold_backward(dt, lam, dscale, ddiag)
    want = mamba3_scan_backward(q, k, v, adt, dt, lam, dy)
    for name, got, ref in zip("dq dk dv dadt ddt dlam".split(), (dq, dk, dv, dadt, ddt, dlam),
                              (want[0][:, :, :, 0], want[1][:, :, :, 0], want[2][:, :, :, 0], want[3], want[4],
                               want[5])):
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-11, err_msg=name)


# --- rotation and A ---------------------------------------------------------------------------------------------------


def test_rope_pairs():
    """SISO turns (2j, 2j+1) as mamba3_siso_step_ref, MIMO (j, j + N/2) as mamba_ssm's MIMO kernel; S pairs."""
    siso = ModelConfig(d_model=64, n_layer=1, layers=["mamba3"])
    mimo = ModelConfig(d_model=64, n_layer=1, layers=["mamba3"], mamba3=Mamba3Config(is_mimo=True, rope_fraction=1.0))
    i0, i1 = rope_pairs(siso)
    assert siso.mamba3_num_rope_angles == 32 and list(i0[:3]) == [0, 2, 4] and list(i1[-2:]) == [61, 63]
    i0, i1 = rope_pairs(mimo)
    assert mimo.mamba3_num_rope_angles == 64 and list(i0[:2]) == [0, 1] and list(i1[:2]) == [64, 65] and i1[-1] == 127


@pytest.mark.parametrize("mimo", [False, True])
def test_rotate_backward_and_norm(mimo):
    rng = np.random.default_rng(6)
    cfg = tiny_config(d_state=8, rope_fraction=0.5, is_mimo=mimo)
    pairs = rope_pairs(cfg)
    x, theta = rng.normal(size=(2, 3, 2, 2, 8)), rng.normal(size=(2, 3, 2, 2))
    out = rotate(x, theta, pairs)
    assert np.allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-14)
    untouched = np.setdiff1d(np.arange(8), np.concatenate(pairs))
    assert len(untouched) == 4 and np.array_equal(out[..., untouched], x[..., untouched])
    dout = rng.normal(size=x.shape)
    dx, dtheta = rotate_backward(out, theta, pairs, dout)
    f = lambda: np.sum(rotate(x, theta, pairs) * dout)
    assert check_grad(f, x, dx) < TOL and check_grad(f, theta, dtheta) < TOL


def test_heavy_tail():
    x = np.array([-9999.0, -3.0, -1e-9, 0.0, 1e-9, 2.0])
    assert np.allclose(heavy_tail(x), [1e-4, 0.25, 1.0, 1.0, 1.0, 3.0], rtol=1e-12)
    x = np.random.default_rng(7).normal(size=20) * 2
    dy = np.random.default_rng(8).normal(size=20)
    assert check_grad(lambda: np.sum(heavy_tail(x) * dy), x, heavy_tail_backward(x, dy)) < TOL


# --- the block --------------------------------------------------------------------------------------------------------


BLOCK_CASES = [dict(), dict(rope_fraction=1.0, is_outproj_norm=True), dict(is_mimo=True, ngroups=2),
               dict(is_mimo=True, mimo_rank=3, rope_fraction=1.0, is_outproj_norm=True, chunk_size=3)]
BLOCK_IDS = ["siso", "siso_rope1_outnorm", "mimo_g2", "mimo_r3_rope1_outnorm"]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=BLOCK_IDS)
def test_block_chunked_equals_step(case):
    """Decoding token by token (angle, state, previous k and v carried) gives the chunked block's outputs."""
    cfg = tiny_config(layers=("mamba3",), d_state=8, **case)
    prefix = "backbone.layers.0.mixer."
    params = {k[len(prefix):]: v for k, v in random_params(cfg).items() if k.startswith(prefix)}
    x = np.random.default_rng(9).normal(size=(2, 9, cfg.d_model))
    y = mamba3_block(params, x, cfg)[0]
    cache = mamba3_init_cache(2, cfg)
    for t in range(x.shape[1]):
        y_t, cache = mamba3_step(params, x[:, t], cache, cfg)
        assert np.abs(y_t - y[:, t]).max() < 1e-12 * np.abs(y).max(), t


def lm_grad_errors(cfg, L, seed=0, batch=2):
    # eps 3e-6 balances the central difference's truncation error (∝ eps², up to 1.2e-6 at eps 1e-5 on the
    # embedding, whose rows pass an RMSNorm over 4 dims) and its round-off (∝ 1/eps, 2.2e-7 at eps 1e-6 on a
    # C_norm.weight with gradients ~1e-3): both ~1e-7 here.
    return gradcheck.lm_grad_errors(random_params(cfg, seed), cfg, L, eps=3e-6, seed=seed, batch=batch)


@pytest.mark.parametrize("case", [
    dict(L=5),  # SISO, rope 0.5, 3 chunks, the last one padded
    dict(L=6, rope_fraction=1.0, is_outproj_norm=True, chunk_size=4),
    dict(L=5, is_mimo=True, ngroups=2, chunk_size=3),
    dict(L=4, is_mimo=True, rope_fraction=1.0, is_outproj_norm=True),
    dict(L=5, A_floor=0.5),  # the floor holds A for some tokens
], ids=["siso", "siso_rope1_outnorm", "mimo_g2", "mimo_rope1_outnorm", "A_floor"])
def test_lm_gradients_every_parameter(case):
    case = dict(case)
    L = case.pop("L")
    errors = lm_grad_errors(tiny_config(**case), L)
    assert max(errors.values()) < TOL, errors


def test_A_floor_bites():
    cfg = tiny_config(A_floor=0.5)
    ids = np.random.default_rng(10).integers(0, cfg.vocab_size, size=(2, 5))
    _, _, saved = lm_forward(random_params(cfg), cfg, ids)
    A = np.concatenate([s["A"].ravel() for _, s in saved["layers"]])
    assert A.max() == -0.5 and np.mean(A < -0.5) > 0.3


def test_mixed_lm_gradients_every_parameter():
    cfg = tiny_config(layers=("mamba1", "mamba3", "mamba2"), is_mimo=True)
    errors = lm_grad_errors(cfg, 5, seed=1)
    assert any(".mixer.x_proj." in k for k in errors) and any(".mixer.A_log" in k for k in errors)
    assert any(".mixer.mimo_o" in k for k in errors)
    assert max(errors.values()) < TOL, errors


def test_lm_chunk_size_independence():
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 11, size=(2, 9))
    base = None
    for chunk in (1, 2, 4, 9, 16):
        cfg = tiny_config(is_mimo=True, chunk_size=chunk)
        logits = lm_forward(random_params(cfg), cfg, ids)[0]
        base = logits if base is None else base
        assert np.allclose(logits, base, rtol=1e-12, atol=1e-12)


# --- config and parameter table -----------------------------------------------------------------------------------


def test_mamba3_defaults_and_dims():
    m = Mamba3Config()
    assert (m.d_state, m.expand, m.headdim, m.ngroups, m.rope_fraction, m.mimo_rank, m.chunk_size) == \
        (128, 2, 64, 1, 0.5, 4, 64)
    assert (m.dt_min, m.dt_max, m.dt_init_floor, m.A_floor) == (1e-3, 0.1, 1e-4, 1e-4)
    assert (m.is_outproj_norm, m.is_mimo) == (False, False)
    cfg = ModelConfig(vocab_size=50277, d_model=768, n_layer=1, layers=["mamba3"])  # the mamba-130m shape
    assert (cfg.mamba3_d_inner, cfg.mamba3_nheads, cfg.mamba3_rank, cfg.mamba3_num_rope_angles) == (1536, 24, 1, 32)
    assert cfg.mamba3_in_proj_dim == 2 * 1536 + 2 * 128 + 3 * 24 + 32
    mimo = ModelConfig(d_model=768, n_layer=1, layers=["mamba3"],
                       mamba3=Mamba3Config(is_mimo=True, rope_fraction=1.0, ngroups=2, d_state=6))
    assert (mimo.mamba3_rank, mimo.mamba3_num_rope_angles, mimo.mamba3_in_proj_dim) == \
        (4, 3, 2 * 1536 + 2 * 4 * 2 * 6 + 3 * 24 + 3)
    odd = ModelConfig(d_model=64, n_layer=1, layers=["mamba3"], mamba3=Mamba3Config(d_state=10))
    assert odd.mamba3_num_rope_angles == 2  # floor(10 · 0.5) = 5, made even, halved (as mamba_ssm)


@pytest.mark.parametrize("mimo,outnorm", [(False, False), (True, True)])
def test_mamba3_specs_names_shapes_and_no_decay(mimo, outnorm):
    cfg = tiny_config(is_mimo=mimo, is_outproj_norm=outnorm, ngroups=2)
    specs = {s.name: s for s in parameter_specs(cfg)}
    p = "backbone.layers.1.mixer."
    R = 2 if mimo else 1
    want = {"in_proj.weight": (2 * 8 + 2 * R * 2 * 4 + 3 * 2 + 1, 4), "dt_bias": (2,), "B_bias": (2, R, 4),
            "C_bias": (2, R, 4), "B_norm.weight": (4,), "C_norm.weight": (4,), "D": (2,), "out_proj.weight": (4, 8)}
    if mimo:
        want |= {"mimo_x": (2, 2, 4), "mimo_z": (2, 2, 4), "mimo_o": (2, 2, 4)}
    if outnorm:
        want["norm.weight"] = (8,)
    got = [k[len(p):] for k in specs if k.startswith(p)]
    assert {k: specs[p + k].shape for k in got} == want
    assert got[:6] == ["in_proj.weight", "dt_bias", "B_bias", "C_bias", "B_norm.weight", "C_norm.weight"]
    assert got[-1] == "out_proj.weight"  # mamba_ssm's registration order
    decayed = {k for k in got if not specs[p + k].no_decay}
    assert decayed == {"in_proj.weight", "out_proj.weight"} | ({"mimo_x", "mimo_z", "mimo_o"} if mimo else set())


def test_mamba3_init():
    cfg = ModelConfig(vocab_size=64, d_model=128, n_layer=2, layers=["mamba3", "mamba3"],
                      mamba3=Mamba3Config(d_state=16, headdim=8, is_mimo=True, is_outproj_norm=True))
    w = init_parameters(cfg, seed=3)
    p = "backbone.layers.0.mixer."
    dt = np.log1p(np.exp(w[p + "dt_bias"].astype(np.float64)))  # softplus(dt_bias) ~ log-U(1e-3, 0.1)
    assert dt.shape == (32,) and 1e-3 * (1 - 1e-5) <= dt.min() and dt.max() <= 0.1 * (1 + 1e-5)
    assert dt.max() / dt.min() > 10
    for k in ("B_bias", "C_bias", "B_norm.weight", "C_norm.weight", "D", "mimo_z", "norm.weight"):
        assert np.all(w[p + k] == 1), k
    assert np.all(w[p + "mimo_x"] == 0.25) and np.all(w[p + "mimo_o"] == 0.25)  # 1 / mimo_rank
    assert np.abs(w[p + "in_proj.weight"]).max() <= 1 / math.sqrt(128)
    assert np.abs(w[p + "out_proj.weight"]).max() <= 1 / math.sqrt(256) / math.sqrt(2)
    assert not np.array_equal(w[p + "dt_bias"], w["backbone.layers.1.mixer.dt_bias"])


def test_config_round_trips_json_and_toml():
    from mambactl.train.config import TrainConfig

    cfg = tiny_config(layers=("mamba1", "mamba3"), is_mimo=True, rope_fraction=1.0, A_floor=0.01)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict(), allow_nan=False))) == cfg
    train = TrainConfig(model=cfg)
    assert TrainConfig.from_toml(train.to_toml()) == train
    assert TrainConfig.from_toml("[model.mamba3]\nis_mimo = true\n").model.mamba3.is_mimo


@pytest.mark.parametrize("mamba3,key", [
    (dict(headdim=5), "model.mamba3.headdim"),  # 8 channels in heads of 5
    (dict(headdim=2, ngroups=3), "model.mamba3.ngroups"),  # 4 heads in 3 groups
    (dict(rope_fraction=0.25), "model.mamba3.rope_fraction"),
    (dict(d_state=3), "model.mamba3.d_state"),  # floor(1.5) = 1 dim: no pair to rotate
    (dict(mimo_rank=0), "model.mamba3.mimo_rank"),
    (dict(chunk_size=0), "model.mamba3.chunk_size"),
    (dict(dt_min=0.2, dt_max=0.1), "model.mamba3.dt_min"),
    (dict(A_floor=0.0), "model.mamba3.A_floor"),
    (dict(is_mimo=1), "model.mamba3.is_mimo"),
])
def test_config_errors_name_the_key(mamba3, key):
    with pytest.raises(MambactlError, match=key.replace(".", r"\.")):
        ModelConfig(d_model=4, n_layer=1, layers=["mamba3"], mamba3=Mamba3Config(**(dict(headdim=4) | mamba3)))


def test_config_unknown_key_and_shape_checks_only_for_mamba3_layers():
    with pytest.raises(MambactlError, match=r"model\.mamba3\.rope: unknown key"):
        ModelConfig.from_dict({"mamba3": {"rope": 0.5}})
    ModelConfig(d_model=6, n_layer=1)  # mamba1 only: the default headdim 64 need not divide d_inner 12
