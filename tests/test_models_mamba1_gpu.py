"""The Mamba-1 LM on the GPU against the float64 reference: logits, loss and every parameter gradient."""

import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.models.config import Mamba1Config, ModelConfig
from mambactl.models.lm import LanguageModel
from mambactl.models.params import init_parameters
from mambactl.reference.lm import lm_backward, lm_forward
from mambactl.runtime.gpu import get_runtime

CONFIGS = {
    # d_model not a multiple of 16, L not a multiple of any chunk, odd vocab padded to 8
    "odd": (ModelConfig(vocab_size=37, d_model=20, n_layer=2, mamba1=Mamba1Config(d_state=5, d_conv=3)), 2, 67),
    "biases": (ModelConfig(vocab_size=16, d_model=8, n_layer=1, mamba1=Mamba1Config(d_state=3, bias=True)), 3, 5),
    "deeper": (ModelConfig(vocab_size=50, d_model=32, n_layer=3, mamba1=Mamba1Config(d_state=16)), 1, 33),
}


def random_weights(cfg, seed):
    """The init plus noise everywhere, so no gradient is trivially zero or one."""
    rng = np.random.default_rng(seed)
    w = init_parameters(cfg, seed)
    for k, v in w.items():
        w[k] = (v + 0.1 * rng.standard_normal(v.shape) * (1 + np.abs(v).mean())).astype(np.float32)
        if k.endswith("dt_proj.bias"):
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


def test_bad_token_ids_and_empty_sequences_fail_before_dispatch(rt):
    cfg, _, _ = CONFIGS["biases"]
    lm = LanguageModel(cfg, rt, init_parameters(cfg, 0))
    with pytest.raises(ShapeError, match="outside the vocabulary"):
        lm.forward(np.array([[1, 2, 16]]))
    with pytest.raises(ShapeError, match="length >= 1"):
        lm.forward(np.zeros((1, 0), np.int64))
    with pytest.raises(ShapeError, match="missing parameter"):
        LanguageModel(cfg, rt, {})
