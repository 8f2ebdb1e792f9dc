"""LMs with Mamba-2 layers on the GPU against the float64 reference LM (logits, loss, every gradient), and a
mixed Mamba-1 / Mamba-2 model that learns."""

import numpy as np
import pytest

from lm_checks import assert_lm_matches_reference, overfit_losses
from mambactl.models.config import Mamba1Config, Mamba2Config, ModelConfig

CONFIGS = {
    # L not a multiple of the chunk; 4 heads of 8 sharing one B/C group
    "mamba2": (ModelConfig(vocab_size=37, d_model=16, n_layer=2, layers=["mamba2"] * 2,
                           mamba2=Mamba2Config(d_state=8, headdim=8, chunk_size=8)), 2, 19),
    # two groups (B/C and the gated norm), biases, no conv bias, a dt_limit that binds, L = chunk + 1; in_proj's
    # bias puts dt's block at byte 272, not a multiple of lavapipe's 32-byte storage
    # offset alignment (row_block copies it there)
    "groups": (ModelConfig(vocab_size=20, d_model=12, n_layer=1, layers=["mamba2"],
                           mamba2=Mamba2Config(d_state=5, d_conv=3, headdim=6, ngroups=2, chunk_size=16, bias=True,
                                               conv_bias=False, dt_limit=[0.05, 1.5])), 2, 17),
    "mixed": (ModelConfig(vocab_size=30, d_model=16, n_layer=3, layers=["mamba1", "mamba2", "mamba1"],
                          mamba1=Mamba1Config(d_state=4), mamba2=Mamba2Config(d_state=6, headdim=8, ngroups=2,
                                                                              chunk_size=8)), 1, 30),
}


# The kernel chunk: the adapter's pick (one chunk here, L ≤ 64 on CPU adapters), or 7, which differs from the
# configs' chunk_size (which the float64 reference runs at) and from L, with a ragged last chunk.
@pytest.mark.parametrize("kernel_chunk", [None, 7])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_lm_matches_float64_reference(gpu, force_chunk, name, kernel_chunk):
    cfg, batch, length = CONFIGS[name]
    assert kernel_chunk is None or (kernel_chunk != cfg.mamba2.chunk_size and length % kernel_chunk)
    force_chunk(kernel_chunk)
    assert_lm_matches_reference(gpu, cfg, batch, length)


def test_mixed_model_loss_falls(gpu):
    """30 AdamW steps on one short sequence: a Mamba-1 / Mamba-2 / Mamba-1 LM memorises it."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layer=3, layers=["mamba1", "mamba2", "mamba1"],
                      mamba1=Mamba1Config(d_state=8), mamba2=Mamba2Config(d_state=16, headdim=16, chunk_size=16))
    first, last = overfit_losses(gpu, cfg, steps=30)
    assert np.isfinite(last) and last < first / 2, (first, last)
