"""The float64 Mamba-2 reference: chunked SSD == the plain recurrence, hand-written backward vs central finite
differences on every element (rel. < 1e-6), and the Mamba2Config / parameter table it rests on."""

import json
import math

import numpy as np
import pytest
import gradcheck
from gradcheck import check_grad

from mambactl.errors import MambactlError
from mambactl.models.config import NO_DT_LIMIT, Mamba1Config, Mamba2Config, ModelConfig
from mambactl.models.params import init_parameters, parameter_specs
from mambactl.reference.activations import silu
from mambactl.reference.lm import lm_backward, lm_forward
from mambactl.reference.rmsnorm import rmsnorm
from mambactl.reference.rmsnorm_gated import rmsnorm_gated, rmsnorm_gated_backward
from mambactl.reference.ssd import ssd, ssd_backward, ssd_chunked, ssd_chunked_backward, ssd_sequential

TOL = 1e-6


def tiny_config(layers=("mamba2", "mamba2"), **mamba2):
    """d_model 6 -> d_inner 12 -> 4 heads of 3 channels; chunk 2 so that short sequences span several chunks."""
    m = dict(d_state=3, d_conv=3, headdim=3, ngroups=1, chunk_size=2) | mamba2
    return ModelConfig(vocab_size=11, d_model=6, n_layer=len(layers), layers=list(layers), pad_vocab_size_multiple=8,
                       mamba1=Mamba1Config(d_state=3, d_conv=3, dt_rank=2), mamba2=Mamba2Config(**m))


def random_params(cfg, seed=0):
    """mamba_ssm's init plus noise on every tensor, so no gradient hides behind a 0 or a 1.

    dt biases ~ N(0, 1) (Δ ≈ 0.7 instead of the init's ~0.01) and Mamba-2 A_log ~ N(0, 0.5) (A ≈ -1 instead of
    down to -16), so the state carries real signal across chunks.
    """
    rng = np.random.default_rng(seed)
    params = {k: v.astype(np.float64) for k, v in init_parameters(cfg, seed).items()}
    for k, v in params.items():
        v += rng.normal(0.0, 0.5 if k.endswith(("x_proj.weight", "in_proj.weight")) else 0.3, v.shape)
        if k.endswith(("dt_proj.bias", "dt_bias")):
            v[...] = rng.normal(0.0, 1.0, v.shape)
        if k.endswith("A_log") and v.ndim == 1:
            v[...] = rng.normal(0.0, 0.5, v.shape)
    return params


def ssd_inputs(rng, b=2, l=7, h=4, p=3, g=2, n=3):
    x = rng.normal(size=(b, l, h, p))
    dt = np.log1p(np.exp(rng.normal(size=(b, l, h))))
    A = -np.exp(rng.normal(size=h) * 0.5)
    return x, dt, A, rng.normal(size=(b, l, g, n)), rng.normal(size=(b, l, g, n))


# --- the SSD scan -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("g", [1, 2, 4])
def test_ssd_chunked_equals_sequential(g):
    rng = np.random.default_rng(1)
    for l in (1, 2, 5, 8, 13):
        x, dt, A, B, C = ssd_inputs(rng, l=l, g=g)
        want = ssd_sequential(x, dt, A, B, C)
        for chunk in (1, 2, 3, 4, 8, 16):
            got = ssd(x, dt, A, B, C, chunk)
            assert got.shape == x.shape
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err < 1e-10, (l, chunk, err)


def test_ssd_is_the_textbook_recurrence():
    """One (batch, head) by scalar loops: state_t = exp(Δ A) state + Δ x ⊗ B, y = state C; head h reads group
    h // (heads per group), as mamba_ssm's and HF's repeat_interleave."""
    rng = np.random.default_rng(2)
    x, dt, A, B, C = ssd_inputs(rng, l=6, h=4, g=2)
    y = ssd(x, dt, A, B, C, 4)
    for b, h in [(0, 0), (1, 1), (1, 2), (0, 3)]:
        grp = h // 2
        state = np.zeros((x.shape[3], B.shape[3]))
        for t in range(x.shape[1]):
            state = math.exp(dt[b, t, h] * A[h]) * state + dt[b, t, h] * np.outer(x[b, t, h], B[b, t, grp])
            assert np.allclose(y[b, t, h], state @ C[b, t, grp], rtol=1e-12, atol=1e-14)


def test_ssd_long_decay_stays_finite():
    """Strong decay over a long chunk (Σ Δ A ≈ -3000): the stable segsum gives exact zeros, never inf - inf."""
    rng = np.random.default_rng(3)
    x, dt, A, B, C = ssd_inputs(rng, l=40, g=1)
    dt = dt * 10
    A = A * 10
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow to 0 is the point
        y = ssd(x, dt, A, B, C, 32)
    assert np.allclose(y, ssd_sequential(x, dt, A, B, C), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("g,l,chunk", [(1, 5, 2), (2, 7, 3), (4, 4, 4)])
def test_ssd_backward(g, l, chunk):
    rng = np.random.default_rng(4)
    x, dt, A, B, C = ssd_inputs(rng, l=l, g=g)
    dy = rng.normal(size=x.shape)
    grads = ssd_backward(x, dt, A, B, C, dy)
    f = lambda: np.sum(ssd(x, dt, A, B, C, chunk) * dy)
    for name, t, grad in zip("x dt A B C".split(), (x, dt, A, B, C), grads):
        assert grad.shape == t.shape
        assert check_grad(f, t, grad) < TOL, name


def core_inputs(rng, b=2, l=7, h=4, p=3, g=2, n=3, strong=False):
    """The core's inputs: adt ≤ 0 (strong: down to ≈ −30 a step) and a scale unrelated to it (as Mamba-3's)."""
    x, dt, A, B, C = ssd_inputs(rng, b, l, h, p, g, n)
    adt = -np.abs(rng.normal(size=(b, l, h))) * (15.0 if strong else 0.7)
    return x, adt, rng.normal(size=(b, l, h)), B, C, rng.normal(size=h)


@pytest.mark.parametrize("g,l,chunk,strong", [(1, 5, 2, False), (2, 7, 3, True), (4, 6, 4, False), (4, 9, 4, True)])
def test_ssd_chunked_core_backward(g, l, chunk, strong):
    """The core with D against central differences on every element; G = 1, 1 < G < H and G = H."""
    rng = np.random.default_rng(11)
    x, adt, scale, B, C, D = core_inputs(rng, l=l, g=g, strong=strong)
    dy = rng.normal(size=x.shape)
    grads = ssd_chunked_backward(x, adt, scale, B, C, dy, D)
    f = lambda: np.sum(ssd_chunked(x, adt, scale, B, C, chunk, D) * dy)
    for name, t, grad in zip("x adt scale B C D".split(), (x, adt, scale, B, C, D), grads):
        assert grad.shape == t.shape
        assert check_grad(f, t, grad) < TOL, name
    assert grads[6] is None
    assert ssd_chunked_backward(x, adt, scale, B, C, dy)[5] is None


@pytest.mark.parametrize("g,l,chunk", [(1, 5, 2), (4, 9, 4)])
def test_ssd_chunked_core_backward_with_diag(g, l, chunk):
    """The core with a diagonal weight (and D) against central differences on every element."""
    rng = np.random.default_rng(12)
    x, adt, scale, B, C, D = core_inputs(rng, l=l, g=g, strong=True)
    diag = rng.normal(size=scale.shape)
    dy = rng.normal(size=x.shape)
    grads = ssd_chunked_backward(x, adt, scale, B, C, dy, D, diag)
    f = lambda: np.sum(ssd_chunked(x, adt, scale, B, C, chunk, D, diag) * dy)
    for name, t, grad in zip("x adt scale B C D diag".split(), (x, adt, scale, B, C, D, diag), grads):
        assert grad.shape == t.shape
        assert check_grad(f, t, grad) < TOL, name


def test_ssd_chunked_core_diag_is_the_recurrence():
    """diag replaces scale in each step's own output term: y_t = exp(adt_t) S_{t−1} C_t + diag_t (B_t·C_t) x_t."""
    rng = np.random.default_rng(13)
    x, adt, scale, B, C, _ = core_inputs(rng, l=7, g=2)
    diag = rng.normal(size=scale.shape)
    h = x.shape[2]
    Bh, Ch = np.repeat(B, h // 2, axis=2), np.repeat(C, h // 2, axis=2)
    state = np.zeros(x.shape[:1] + x.shape[2:] + B.shape[-1:])
    want = np.zeros_like(x)
    for t in range(x.shape[1]):
        before = np.exp(adt[:, t])[..., None, None] * state
        want[:, t] = np.einsum("bhpn,bhn->bhp", before, Ch[:, t]) \
            + (diag[:, t] * np.einsum("bhn,bhn->bh", Bh[:, t], Ch[:, t]))[..., None] * x[:, t]
        state = before + (scale[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None]
    np.testing.assert_allclose(ssd_chunked(x, adt, scale, B, C, 3, diag=diag), want, rtol=1e-10, atol=1e-12)


def test_ssd_chunked_core_is_the_recurrence():
    """scale and adt independent: the chunked core equals the step-by-step recurrence with D x added."""
    rng = np.random.default_rng(12)
    x, adt, scale, B, C, D = core_inputs(rng, l=11, g=2, strong=True)
    Bh, Ch = np.repeat(B, 2, axis=2), np.repeat(C, 2, axis=2)
    state = np.zeros((2, 4, 3, 3))
    want = np.zeros_like(x)
    for t in range(11):
        added = (scale[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None]
        state = np.exp(adt[:, t])[..., None, None] * state + added
        want[:, t] = np.einsum("bhpn,bhn->bhp", state, Ch[:, t]) + D[:, None] * x[:, t]
    for chunk in (1, 3, 4, 16):
        assert np.allclose(ssd_chunked(x, adt, scale, B, C, chunk, D), want, rtol=1e-10, atol=1e-12), chunk


# --- the gated norm -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [12, 6, 3])
def test_rmsnorm_gated_backward(group_size):
    rng = np.random.default_rng(5)
    y, z, w = rng.normal(size=(2, 3, 12)), rng.normal(size=(2, 3, 12)), 1 + 0.3 * rng.normal(size=12)
    dy = rng.normal(size=y.shape)
    grads = rmsnorm_gated_backward(y, z, w, group_size, dy, 1e-5)
    f = lambda: np.sum(rmsnorm_gated(y, z, w, group_size, 1e-5) * dy)
    for name, t, grad in zip(("y", "z", "w"), (y, z, w), grads):
        assert check_grad(f, t, grad) < TOL, name


def test_rmsnorm_gated_groups():
    """One group is RMSNorm(y · SiLU(z)); G groups normalise each block of D / G channels on its own."""
    rng = np.random.default_rng(6)
    y, z, w = rng.normal(size=(4, 12)), rng.normal(size=(4, 12)), rng.normal(size=12)
    assert np.allclose(rmsnorm_gated(y, z, w, 12), rmsnorm(y * silu(z), w, 1e-5), rtol=1e-14)
    out = rmsnorm_gated(y, z, w, 4)
    for k in range(3):
        cols = slice(4 * k, 4 * k + 4)
        assert np.allclose(out[:, cols], rmsnorm(y[:, cols] * silu(z[:, cols]), w[cols], 1e-5), rtol=1e-14)


# --- the LM -------------------------------------------------------------------------------------------------------


def lm_grad_errors(cfg, L, seed=0, batch=2):
    # eps 1e-6: the gated norm over groups of 3 channels curves sharply, and the central difference's truncation
    # error (∝ eps²) reached 1.6e-6 at eps 1e-5 in the g4 case; round-off at 1e-6 stays below 1e-9.
    return gradcheck.lm_grad_errors(random_params(cfg, seed), cfg, L, eps=1e-6, seed=seed, batch=batch)


@pytest.mark.parametrize("case", [
    dict(L=5, mamba2=dict(ngroups=1, chunk_size=2)),  # 3 chunks, the last one padded
    dict(L=7, mamba2=dict(ngroups=2, chunk_size=3)),
    dict(L=4, mamba2=dict(ngroups=4, chunk_size=8, bias=True)),  # one group per head, one padded chunk; biases
    dict(L=6, mamba2=dict(ngroups=2, chunk_size=4, conv_bias=False, dt_limit=[0.3, 1.2])),  # the clamp bites
], ids=["g1_chunk2_L5", "g2_chunk3_L7", "g4_bias", "g2_dt_limit_no_conv_bias"])
def test_lm_gradients_every_parameter(case):
    errors = lm_grad_errors(tiny_config(**case["mamba2"]), case["L"])
    assert max(errors.values()) < TOL, errors


def test_dt_limit_clamps():
    """With dt_limit set, Δ is clamped (some entries sit at each bound in the case above)."""
    cfg = tiny_config(ngroups=2, chunk_size=4, dt_limit=[0.3, 1.2])
    params = random_params(cfg)
    ids = np.random.default_rng(10).integers(0, cfg.vocab_size, size=(2, 6))
    _, _, saved = lm_forward(params, cfg, ids)
    delta = np.concatenate([s["delta"].ravel() for _, s in saved["layers"]])
    assert delta.min() == 0.3 and delta.max() == 1.2 and np.mean((delta > 0.3) & (delta < 1.2)) > 0.3


def test_mixed_lm_gradients_every_parameter():
    cfg = tiny_config(layers=("mamba1", "mamba2", "mamba1"), ngroups=2, chunk_size=3)
    errors = lm_grad_errors(cfg, 5, seed=1)
    assert any(".mixer.x_proj." in k for k in errors) and any(".mixer.dt_bias" in k for k in errors)
    assert max(errors.values()) < TOL, errors


def test_lm_length_one_and_chunk_size_independence():
    """Logits do not depend on the chunk size (any L, padded or not)."""
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 11, size=(2, 9))
    base = None
    for chunk in (1, 2, 4, 9, 16):
        cfg = tiny_config(ngroups=2, chunk_size=chunk)
        logits = lm_forward(random_params(cfg), cfg, ids)[0]
        base = logits if base is None else base
        assert np.allclose(logits, base, rtol=1e-12, atol=1e-12)
    cfg = tiny_config(ngroups=2)
    params = random_params(cfg)
    _, _, saved = lm_forward(params, cfg, ids[:, :1], ids[:, :1])
    grads = lm_backward(params, cfg, saved)
    f = lambda: lm_forward(params, cfg, ids[:, :1], ids[:, :1])[1]
    assert max(check_grad(f, params[k], grads[k]) for k in params) < TOL


# --- config and parameter table -----------------------------------------------------------------------------------


def test_mamba2_defaults_and_dims():
    m = Mamba2Config()
    assert (m.d_state, m.d_conv, m.expand, m.headdim, m.ngroups, m.chunk_size) == (128, 4, 2, 64, 1, 256)
    assert m.A_init_range == [1.0, 16.0] and m.dt_limit == [0.0, NO_DT_LIMIT] and not m.has_dt_limit
    assert m.dt_limit_inf == (0.0, math.inf) and (m.conv_bias, m.bias, m.norm_before_gate) == (True, False, False)
    cfg = ModelConfig(vocab_size=50277, d_model=768, n_layer=2, layers=["mamba2", "mamba1"],
                      pad_vocab_size_multiple=16)
    assert (cfg.mamba2_d_inner, cfg.mamba2_nheads, cfg.mamba2_conv_dim, cfg.mamba2_in_proj_dim) == \
        (1536, 24, 1536 + 256, 2 * 1536 + 256 + 24)
    assert cfg.d_inner == 1536 and cfg.dt_rank == 48  # Mamba-1's derived dims are unchanged


def test_mamba2_specs_names_shapes_and_no_decay():
    cfg = tiny_config(ngroups=2, bias=True)
    specs = {s.name: s for s in parameter_specs(cfg)}
    p = "backbone.layers.1.mixer."
    want = {"in_proj.weight": (2 * 12 + 2 * 2 * 3 + 4, 6), "in_proj.bias": (40,), "conv1d.weight": (24, 1, 3),
            "conv1d.bias": (24,), "dt_bias": (4,), "A_log": (4,), "D": (4,), "norm.weight": (12,),
            "out_proj.weight": (6, 12), "out_proj.bias": (6,)}
    assert {k[len(p):]: s.shape for k, s in specs.items() if k.startswith(p)} == want
    decayed = {k[len(p):] for k, s in specs.items() if k.startswith(p) and not s.no_decay}
    assert decayed == {"in_proj.weight", "conv1d.weight", "out_proj.weight"}


def test_mamba2_init():
    cfg = ModelConfig(vocab_size=64, d_model=128, n_layer=2, layers=["mamba2", "mamba2"],
                      mamba2=Mamba2Config(d_state=16, headdim=8))
    w = init_parameters(cfg, seed=3)
    p = "backbone.layers.0.mixer."
    A = np.exp(w[p + "A_log"].astype(np.float64))
    assert A.shape == (32,) and 1 <= A.min() and A.max() <= 16 and A.max() - A.min() > 5  # U(1, 16)
    dt = np.log1p(np.exp(w[p + "dt_bias"].astype(np.float64)))  # softplus(dt_bias) ~ log-U(1e-3, 0.1)
    assert 1e-3 * (1 - 1e-5) <= dt.min() and dt.max() <= 0.1 * (1 + 1e-5) and dt.max() / dt.min() > 10
    assert np.all(w[p + "D"] == 1) and np.all(w[p + "norm.weight"] == 1)
    bound = 1 / math.sqrt(4)  # PyTorch's default conv init, fan_in = d_conv
    assert np.abs(w[p + "conv1d.weight"]).max() <= bound and np.abs(w[p + "conv1d.bias"]).max() <= bound
    assert np.abs(w[p + "out_proj.weight"]).max() <= 1 / math.sqrt(256) / math.sqrt(2)
    assert not np.array_equal(w[p + "A_log"], w["backbone.layers.1.mixer.A_log"])


def test_config_round_trips_json_and_toml():
    from mambactl.train.config import TrainConfig

    cfg = tiny_config(layers=("mamba1", "mamba2"), ngroups=2, dt_limit=[0.001, 5.0])
    again = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict(), allow_nan=False)))
    assert again == cfg and again.mamba2.dt_limit == [0.001, 5.0] and again.mamba2.has_dt_limit
    plain = tiny_config()
    assert ModelConfig.from_dict(json.loads(json.dumps(plain.to_dict(), allow_nan=False))) == plain
    train = TrainConfig(model=cfg)
    assert TrainConfig.from_toml(train.to_toml()) == train
    assert TrainConfig.from_toml("[model.mamba2]\nheaddim = 32\n").model.mamba2.headdim == 32


def test_dt_limit_spellings():
    """mamba_ssm / HF spell "no limit" (0, inf); JSON has no inf, so null is read the same way."""
    for hi in (math.inf, None, NO_DT_LIMIT):
        m = Mamba2Config(dt_limit=(0.0, hi))
        assert m.dt_limit == [0.0, NO_DT_LIMIT] and not m.has_dt_limit
    assert Mamba2Config(A_init_range=(2, 4)).A_init_range == [2, 4]


@pytest.mark.parametrize("mamba2,key", [
    (dict(headdim=5), "model.mamba2.headdim"),  # 12 channels in heads of 5
    (dict(headdim=3, ngroups=3), "model.mamba2.ngroups"),  # 4 heads in 3 groups
    (dict(headdim=0), "model.mamba2.headdim"),
    (dict(chunk_size=0), "model.mamba2.chunk_size"),
    (dict(d_conv=0), "model.mamba2.d_conv"),
    (dict(dt_min=0.2, dt_max=0.1), "model.mamba2.dt_min"),
    (dict(A_init_range=[0.0, 16.0]), "model.mamba2.A_init_range"),
    (dict(A_init_range=[1.0]), "model.mamba2.A_init_range"),
    (dict(dt_limit=[1.0, 0.5]), "model.mamba2.dt_limit"),
    (dict(dt_limit=[-1.0, 2.0]), "model.mamba2.dt_limit"),
    (dict(norm_before_gate=True), "model.mamba2.norm_before_gate"),
])
def test_config_errors_name_the_key(mamba2, key):
    with pytest.raises(MambactlError, match=key.replace(".", r"\.")):
        ModelConfig(d_model=6, n_layer=1, layers=["mamba2"], mamba2=Mamba2Config(**mamba2))


def test_config_unknown_key_and_shape_checks_only_for_mamba2_layers():
    with pytest.raises(MambactlError, match=r"model\.mamba2\.head_dim: unknown key"):
        ModelConfig.from_dict({"mamba2": {"head_dim": 32}})
    ModelConfig(d_model=6, n_layer=1)  # mamba1 only: the default headdim 64 need not divide d_inner 12
    with pytest.raises(MambactlError, match="layer type 'mamba4'"):
        ModelConfig(n_layer=1, layers=["mamba4"])
