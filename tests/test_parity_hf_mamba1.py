"""Parity with the field: HF transformers' `MambaForCausalLM` (its pure-torch path) vs the float64 reference.

Same random weights loaded by name; logits, loss (labels = ids, shifted inside HF) and every gradient compared.
"""

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from hf_parity import errors, run_both  # noqa: E402  (needs torch)
from transformers.models.mamba import modeling_mamba  # noqa: E402

from mambactl.models.config import Mamba1Config, ModelConfig  # noqa: E402

for _pkg in ("mamba_ssm", "causal_conv1d"):  # use_mambapy=False below keeps mamba.py out
    if importlib.util.find_spec(_pkg):
        pytest.skip(f"{_pkg} is installed: HF would not take its pure-torch path", allow_module_level=True)

CFG = ModelConfig(vocab_size=11, d_model=6, n_layer=2, pad_vocab_size_multiple=8,
                  mamba1=Mamba1Config(d_state=3, d_conv=3, dt_rank=2))


def hf_model(cfg, seed=0):
    """A float64 MambaForCausalLM of cfg's shape with every parameter randomised (A_log, D, norms included)."""
    m = cfg.mamba1
    hf_cfg = transformers.MambaConfig(
        vocab_size=cfg.padded_vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
        state_size=m.d_state, conv_kernel=m.d_conv, expand=m.expand, time_step_rank=cfg.dt_rank,
        use_bias=m.bias, use_conv_bias=m.conv_bias, layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=True,
        residual_in_fp32=False, use_mambapy=False, use_associative_scan=False, use_cache=False)
    torch.manual_seed(seed)
    model = transformers.MambaForCausalLM(hf_cfg).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p))
            if name.endswith("dt_proj.bias"):
                p.copy_(torch.randn_like(p))  # Δ ≈ 0.7, so the scan carries real signal
    return model


@pytest.fixture
def hf_in_float64(monkeypatch):
    """HF's slow path upcasts with `.float()` and RMSNorm computes in float32; in a float64 model those are
    downcasts to float32. Keep float64 throughout (same formulas) so the comparison is exact to rounding."""
    monkeypatch.setattr(torch.Tensor, "float", lambda t: t if t.dtype == torch.float64 else t.to(torch.float32))
    monkeypatch.setattr(modeling_mamba.MambaRMSNorm, "forward", lambda self, h: self.weight * h * torch.rsqrt(
        h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.mark.parametrize("bias", [False, True], ids=["default", "with_biases"])
def test_parity_float64(hf_in_float64, bias):
    cfg = ModelConfig(**(CFG.to_dict() | {"mamba1": CFG.to_dict()["mamba1"] | {"bias": bias}}))
    ours, theirs = run_both(cfg, hf_model(cfg))
    assert theirs[0].dtype == np.float64
    logits_err, loss_err, grad_err = errors(ours, theirs)
    assert logits_err < 1e-12 and loss_err < 1e-12 and grad_err < 1e-10, (logits_err, loss_err, grad_err)


def test_parity_hf_as_shipped():
    """Unpatched HF (float32 casts inside its float64 model) agrees to float32 precision."""
    ours, theirs = run_both(CFG, hf_model(CFG))
    logits_err, loss_err, grad_err = errors(ours, theirs)
    assert logits_err < 1e-5 and loss_err < 1e-5 and grad_err < 1e-5, (logits_err, loss_err, grad_err)
