"""The Mamba-1 LM on the GPU against the float64 reference: logits, loss and every parameter gradient."""

import numpy as np
import pytest

from lm_checks import assert_lm_matches_reference, overfit_losses
from mambactl.errors import ShapeError
from mambactl.models.config import Mamba1Config, ModelConfig
from mambactl.models.lm import LanguageModel
from mambactl.models.params import init_parameters

CONFIGS = {
    # d_model not a multiple of 16, L not a multiple of any chunk, odd vocab padded to 8
    "odd": (ModelConfig(vocab_size=37, d_model=20, n_layer=2, mamba1=Mamba1Config(d_state=5, d_conv=3)), 2, 67),
    "biases": (ModelConfig(vocab_size=16, d_model=8, n_layer=1, mamba1=Mamba1Config(d_state=3, bias=True)), 3, 5),
    "deeper": (ModelConfig(vocab_size=50, d_model=32, n_layer=3, mamba1=Mamba1Config(d_state=16)), 1, 33),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_lm_matches_float64_reference(gpu, name):
    cfg, batch, length = CONFIGS[name]
    assert_lm_matches_reference(gpu, cfg, batch, length)


def test_loss_halves_when_overfitting_a_short_text(gpu):
    """50 AdamW steps on one short sequence: the Mamba-1 LM memorises it (loss falls by more than half)."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layer=2, mamba1=Mamba1Config(d_state=8))
    first, last = overfit_losses(gpu, cfg, steps=50)
    assert last < first / 2, (first, last)


def test_bad_token_ids_and_empty_sequences_fail_before_dispatch(gpu):
    cfg, _, _ = CONFIGS["biases"]
    lm = LanguageModel(cfg, gpu, init_parameters(cfg, 0))
    with pytest.raises(ShapeError, match="outside the vocabulary"):
        lm.forward(np.array([[1, 2, 16]]))
    with pytest.raises(ShapeError, match="length >= 1"):
        lm.forward(np.zeros((1, 0), np.int64))
    with pytest.raises(ShapeError, match="missing parameter"):
        LanguageModel(cfg, gpu, {})
