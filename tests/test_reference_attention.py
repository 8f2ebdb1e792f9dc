"""The float64 attention reference: backward vs central finite differences (rel. < 1e-6), forward and backward
vs torch's scaled_dot_product_attention, rope vs the HF Llama formulation, and the hybrid LM's gradients."""

import numpy as np
import pytest
import torch
from gradcheck import check_grad

from mambactl.errors import MambactlError
from mambactl.models.config import AttentionConfig, Mamba1Config, ModelConfig
from mambactl.models.params import init_parameters, parameter_specs
from mambactl.reference import attention as ref
from mambactl.reference.lm import lm_backward, lm_forward

TOL = 1e-6


def qkv(rng, B=2, L=5, H=3, Dh=4):
    return tuple(rng.normal(size=(B, L, H, Dh)) for _ in range(3))


@pytest.mark.parametrize("causal", [True, False])
def test_attention_backward_matches_finite_differences(causal):
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng)
    do = rng.normal(size=q.shape)
    grads = ref.attention_backward(q, k, v, do, causal)
    f = lambda: np.sum(ref.attention(q, k, v, causal) * do)
    for x, g in zip((q, k, v), grads):
        assert check_grad(f, x, g) < TOL


def test_rope_backward_matches_finite_differences():
    rng = np.random.default_rng(1)
    x, dy = rng.normal(size=(2, 6, 2, 8)), rng.normal(size=(2, 6, 2, 8))
    f = lambda: np.sum(ref.rope(x, 50.0) * dy)
    assert check_grad(f, x, ref.rope_backward(dy, 50.0)) < TOL


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("L,Dh", [(1, 4), (9, 3), (17, 16)])
def test_matches_torch_scaled_dot_product_attention(causal, L, Dh):
    """Forward and, through torch autograd, the backward (torch's layout is [B, H, L, Dh])."""
    rng = np.random.default_rng(L)
    q, k, v = qkv(rng, L=L, Dh=Dh)
    do = rng.normal(size=q.shape)
    tq, tk, tv = (torch.tensor(a.transpose(0, 2, 1, 3), requires_grad=True) for a in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    out.backward(torch.tensor(do.transpose(0, 2, 1, 3)))
    np.testing.assert_allclose(ref.attention(q, k, v, causal), out.detach().numpy().transpose(0, 2, 1, 3),
                               rtol=1e-12, atol=1e-12)
    for mine, t in zip(ref.attention_backward(q, k, v, do, causal), (tq, tk, tv)):
        np.testing.assert_allclose(mine, t.grad.numpy().transpose(0, 2, 1, 3), rtol=1e-10, atol=1e-12)


def torch_rope(x, base):
    """HF Llama's rotary embedding: inv_freq, cos/sin of cat(freqs, freqs) and rotate_half, on [B, H, L, Dh]."""
    L, Dh = x.shape[2], x.shape[3]
    inv_freq = 1.0 / (base ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh))
    freqs = torch.outer(torch.arange(L, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    rotate_half = torch.cat([-x[..., Dh // 2:], x[..., : Dh // 2]], dim=-1)
    return x * emb.cos() + rotate_half * emb.sin()


def test_rope_matches_the_hf_llama_formulation():
    x = np.random.default_rng(2).normal(size=(2, 33, 3, 10))
    want = torch_rope(torch.tensor(x.transpose(0, 2, 1, 3)), 10000.0).numpy().transpose(0, 2, 1, 3)
    np.testing.assert_allclose(ref.rope(x), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ref.rope(x)[:, 0], x[:, 0])  # position 0 is not turned


def hybrid_config(**attention):
    return ModelConfig(vocab_size=11, d_model=8, n_layer=2, layers=["mamba1", "attention"],
                       mamba1=Mamba1Config(d_state=3, d_conv=3, dt_rank=2),
                       attention=AttentionConfig(**(dict(n_heads=2) | attention)))


@pytest.mark.parametrize("attention", [dict(), dict(rope=False, bias=True), dict(n_heads=1, rope_base=30.0)],
                         ids=["rope", "no_rope_biases", "one_head"])
def test_hybrid_lm_gradients_every_parameter(attention):
    cfg = hybrid_config(**attention)
    rng = np.random.default_rng(3)
    params = {k: v.astype(np.float64) + rng.normal(0.0, 0.3, v.shape) for k, v in init_parameters(cfg, 0).items()}
    assert set(params) == {s.name for s in parameter_specs(cfg)}
    assert params["backbone.layers.1.mixer.qkv_proj.weight"].shape == (24, 8)
    assert ("backbone.layers.1.mixer.out_proj.bias" in params) == cfg.attention.bias
    ids = rng.integers(0, cfg.vocab_size, size=(2, 6))
    targets = np.concatenate([ids[:, 1:], np.full((2, 1), -100)], axis=1)
    _, loss, saved = lm_forward(params, cfg, ids, targets)
    grads = lm_backward(params, cfg, saved)
    assert set(grads) == set(params) and np.isfinite(loss)
    f = lambda: lm_forward(params, cfg, ids, targets)[1]
    errors = {k: check_grad(f, params[k], grads[k]) for k in params}
    assert max(errors.values()) < TOL, errors


def test_block_splits_qkv_by_columns_and_heads():
    """Head h of q is columns [h·Dh, (h+1)·Dh) of the first d_model outputs: a permutation of the heads
    (same permutation of q, k, v rows and of out_proj columns) leaves the layer unchanged."""
    cfg = hybrid_config(rope=False)
    rng = np.random.default_rng(4)
    d, Dh = 8, 4
    w = {"qkv_proj.weight": rng.normal(size=(3 * d, d)), "out_proj.weight": rng.normal(size=(d, d))}
    x = rng.normal(size=(1, 5, d))
    perm = np.r_[Dh:d, 0:Dh]
    swapped = {"qkv_proj.weight": w["qkv_proj.weight"][np.concatenate([perm, d + perm, 2 * d + perm])],
               "out_proj.weight": w["out_proj.weight"][:, perm]}
    y, _ = ref.attention_block(w, x, cfg)
    np.testing.assert_allclose(ref.attention_block(swapped, x, cfg)[0], y, rtol=1e-12, atol=1e-12)
    q, k, v = ((x.reshape(-1, d) @ w["qkv_proj.weight"][i * d:(i + 1) * d].T).reshape(1, 5, 2, Dh) for i in range(3))
    want = ref.attention(q, k, v).reshape(5, d) @ w["out_proj.weight"].T
    np.testing.assert_allclose(y.reshape(5, d), want, rtol=1e-12, atol=1e-12)


def test_config_checks_heads():
    with pytest.raises(MambactlError, match="attention.n_heads: must divide d_model"):
        hybrid_config(n_heads=3)
    with pytest.raises(MambactlError, match="attention.rope: needs an even head dim"):
        ModelConfig(d_model=6, n_layer=1, layers=["attention"], attention=AttentionConfig(n_heads=2))
    with pytest.raises(MambactlError, match="at most 128"):
        ModelConfig(d_model=258, n_layer=1, layers=["attention"], attention=AttentionConfig(n_heads=1, rope=False))
    cfg = ModelConfig.from_dict(hybrid_config(rope=False).to_dict())
    assert cfg.attention == AttentionConfig(n_heads=2, rope=False)


@pytest.mark.parametrize("rope_base", [None, 30.0])
def test_step_equals_the_parallel_rows(rope_base):
    """Stepping positions 1 .. L−1 one at a time from a one-position cache gives every row of the causal
    parallel attention (q, k rotated at their positions) and leaves the rotated k and v in the cache."""
    rng = np.random.default_rng(7)
    B, L, H, Dh = 2, 6, 3, 4
    q, k, v = qkv(rng, B, L, H, Dh)
    rot = (lambda x: ref.rope(x, rope_base)) if rope_base else (lambda x: x)
    want = ref.attention(rot(q), rot(k), v)
    k_cache, v_cache = rot(k)[:, :1], v[:, :1]
    for t in range(1, L):
        row = np.concatenate([x[:, t].reshape(B, H * Dh) for x in (q, k, v)], axis=1)
        o, k_cache, v_cache = ref.attention_step(row, k_cache, v_cache, H, rope_base)
        assert np.abs(o - want[:, t].reshape(B, H * Dh)).max() < 1e-12
    assert np.abs(k_cache - rot(k)).max() < 1e-12 and np.array_equal(v_cache, v)
