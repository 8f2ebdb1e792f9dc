"""LMs with Mamba-2 layers on the GPU against the float64 reference LM (logits, loss, every gradient), and a
mixed Mamba-1 / Mamba-2 model that learns."""

import numpy as np
import pytest

from mambactl.models.config import Mamba1Config, Mamba2Config, ModelConfig
from mambactl.models.lm import LanguageModel
from mambactl.models.params import init_parameters, parameter_specs
from mambactl.ops.adamw import AdamWState, adamw_step
from mambactl.reference.lm import lm_backward, lm_forward
from mambactl.runtime.gpu import get_runtime

CONFIGS = {
    # L not a multiple of the chunk; 4 heads of 8 sharing one B/C group
    "mamba2": (ModelConfig(vocab_size=37, d_model=16, n_layer=2, layers=["mamba2"] * 2,
                           mamba2=Mamba2Config(d_state=8, headdim=8, chunk_size=8)), 2, 19),
    # two groups (B/C and the gated norm), biases, no conv bias, a dt_limit that binds, L = chunk + 1
    "groups": (ModelConfig(vocab_size=20, d_model=12, n_layer=1, layers=["mamba2"],
                           mamba2=Mamba2Config(d_state=5, d_conv=3, headdim=6, ngroups=2, chunk_size=16, bias=True,
                                               conv_bias=False, dt_limit=[0.05, 1.5])), 2, 17),
    "mixed": (ModelConfig(vocab_size=30, d_model=16, n_layer=3, layers=["mamba1", "mamba2", "mamba1"],
                          mamba1=Mamba1Config(d_state=4), mamba2=Mamba2Config(d_state=6, headdim=8, ngroups=2,
                                                                              chunk_size=8)), 1, 30),
}


def random_weights(cfg, seed):
    """The init plus noise everywhere, so no gradient is trivially zero or one."""
    rng = np.random.default_rng(seed)
    w = init_parameters(cfg, seed)
    for k, v in w.items():
        w[k] = (v + 0.1 * rng.standard_normal(v.shape) * (1 + np.abs(v).mean())).astype(np.float32)
        if k.endswith("dt_proj.bias") or k.endswith("dt_bias"):
            w[k] = rng.normal(0, 1, v.shape).astype(np.float32)
    return w


def rel(gpu, ref):
    gpu = np.asarray(gpu, np.float64)
    assert np.all(np.isfinite(gpu))
    return np.linalg.norm(gpu - ref) / np.linalg.norm(ref)


@pytest.fixture(scope="module")
def rt():
    r = get_runtime()
    r.poison = True
    yield r
    r.poison = False


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_lm_matches_float64_reference(rt, name):
    cfg, B, L = CONFIGS[name]
    rng = np.random.default_rng(1)
    weights = random_weights(cfg, 2)
    ids = rng.integers(0, cfg.vocab_size, (B, L))
    targets = np.concatenate([ids[:, 1:], np.full((B, 1), -100)], axis=1)

    lm = LanguageModel(cfg, rt, weights)
    loss, logits, saved = lm.forward(ids, targets)
    lm.backward(saved)

    w64 = {k: v.astype(np.float64) for k, v in weights.items()}
    ref_logits, ref_loss, ref_saved = lm_forward(w64, cfg, ids, targets)
    ref_grads = lm_backward(w64, cfg, ref_saved)

    assert rel(logits.numpy(), ref_logits.reshape(B * L, -1)) < 1e-4
    assert rel(loss.numpy(), [ref_loss]) < 1e-4
    grads = lm.grads_numpy()
    assert set(grads) == set(ref_grads)
    for k, g in ref_grads.items():
        assert rel(grads[k], g) < 1e-3, k


def test_mixed_model_loss_falls():
    """30 AdamW steps on one short sequence: a Mamba-1 / Mamba-2 / Mamba-1 LM memorises it."""
    rt = get_runtime()
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layer=3, layers=["mamba1", "mamba2", "mamba1"],
                      mamba1=Mamba1Config(d_state=8), mamba2=Mamba2Config(d_state=16, headdim=16, chunk_size=16))
    lm = LanguageModel(cfg, rt, init_parameters(cfg, 0))
    specs = parameter_specs(cfg)
    params = [lm.params[s.name] for s in specs]
    grads = [lm.grads[s.name] for s in specs]
    opt = AdamWState.zeros(params)
    seq = np.array([[ord(c) % 64 for c in "the quick brown fox jumps over the lazy dog"]])
    ids, targets = seq[:, :-1], seq[:, 1:]
    losses = []
    for _ in range(30):
        lm.zero_grad()
        loss, _, saved = lm.forward(ids, targets)
        lm.backward(saved)
        adamw_step(params, grads, opt, lr=1e-2, no_decay=[s.no_decay for s in specs], weight_decay=0.1,
                   max_grad_norm=1.0)
        losses.append(loss)
    first, last = float(losses[0].numpy()[0]), float(losses[-1].numpy()[0])
    assert np.isfinite(last) and last < first / 2, (first, last)
