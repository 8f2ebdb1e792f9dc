"""Hybrid LMs with attention layers on the GPU against the float64 reference LM (logits, loss, every gradient),
and a hybrid that learns."""

import numpy as np
import pytest

from lm_checks import assert_lm_matches_reference, overfit_losses
from mambactl.models.config import AttentionConfig, Mamba1Config, Mamba2Config, ModelConfig

CONFIGS = {
    # rope, L over one 64-row query tile and two 32-key tiles
    "mamba1+attention": (ModelConfig(vocab_size=37, d_model=16, n_layer=2, layers=["mamba1", "attention"],
                                     mamba1=Mamba1Config(d_state=4), attention=AttentionConfig(n_heads=2)), 2, 67),
    # Jamba-style: no positional embedding in attention, biases, three heads
    "mamba2+attention": (ModelConfig(vocab_size=20, d_model=24, n_layer=3, layers=["mamba2", "attention", "mamba2"],
                                     mamba2=Mamba2Config(d_state=4, headdim=12, chunk_size=8),
                                     attention=AttentionConfig(n_heads=3, rope=False, bias=True)), 1, 21),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_lm_matches_float64_reference(gpu, name):
    cfg, batch, length = CONFIGS[name]
    assert_lm_matches_reference(gpu, cfg, batch, length)


def test_hybrid_loss_falls(gpu):
    """30 AdamW steps on one short sequence: a Mamba-1 / attention LM memorises it."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layer=2, layers=["mamba1", "attention"],
                      mamba1=Mamba1Config(d_state=8), attention=AttentionConfig(n_heads=4))
    first, last = overfit_losses(gpu, cfg, steps=30)
    assert np.isfinite(last) and last < first / 2, (first, last)
