"""Running the float64 reference LM and a transformers model with the same weights (test-only; needs torch)."""

import functools

import numpy as np
import torch

from mambactl.models.params import parameter_specs
from mambactl.reference.lm import lm_backward, lm_forward


def run_both(cfg, model, length=7, batch=2):
    """Same weights (by name), same random tokens -> (ours, HF), each (logits, loss, grads) in float64 numpy."""
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    specs = {s.name: s.shape for s in parameter_specs(cfg)}
    assert set(sd) - {"lm_head.weight"} == set(specs)
    assert all(sd[k].shape == shape for k, shape in specs.items())
    params = {k: sd[k] for k in specs}

    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(batch, length))
    targets = np.concatenate([ids[:, 1:], np.full((batch, 1), -100)], axis=1)
    logits, loss, saved = lm_forward(params, cfg, ids, targets)
    grads = lm_backward(params, cfg, saved)

    model.train()  # the training branch; without mamba_ssm its fused kernels are absent and the torch path runs
    out = model(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(ids), use_cache=False)
    out.loss.backward()
    hf_grads = {k: p.grad.numpy() for k, p in model.named_parameters()}
    return (logits, loss, grads), (out.logits.detach().numpy(), out.loss.item(), hf_grads)


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def errors(ours, theirs):
    """-> (logits, loss, worst gradient) relative errors; the gradient name sets must match."""
    (logits, loss, grads), (hf_logits, hf_loss, hf_grads) = ours, theirs
    assert set(hf_grads) == set(grads)
    return rel(logits, hf_logits), abs(loss - hf_loss) / abs(hf_loss), max(rel(grads[k], hf_grads[k]) for k in grads)


@functools.lru_cache(maxsize=None)
def hf_mamba2_groups_gated_norm() -> bool:
    """Whether the installed transformers normalises Mamba-2's gated RMSNorm per group of d_inner / n_groups
    channels, as mamba_ssm does (and as we do). Some releases normalise the whole d_inner row instead; such a
    version is no oracle for n_groups > 1. Decided by running its MambaRMSNormGated, not by version number."""
    import transformers

    config = transformers.Mamba2Config(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_heads=4, head_dim=4,
                                       state_size=2, n_groups=2, use_cache=False)
    norm = transformers.Mamba2ForCausalLM(config).backbone.layers[0].mixer.norm
    h = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 4.0, 16)
    with torch.no_grad():
        got = norm(h).double()
    g = h.double().view(3, 2, 8)
    grouped = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).view(3, 16)
    return bool(torch.allclose(got, grouped * norm.weight.double(), rtol=1e-5, atol=1e-6))


def skip_unless_hf_groups_gated_norm(ngroups: int) -> None:
    """Skip a comparison with transformers' Mamba-2 at ngroups > 1 when the installed version does not group its
    gated norm (it then computes a different function from mamba_ssm's, so it cannot judge ours)."""
    import pytest
    import transformers

    if ngroups > 1 and not hf_mamba2_groups_gated_norm():
        pytest.skip(f"transformers {transformers.__version__} normalises Mamba-2's gated RMSNorm over the whole "
                    f"row, not per group like mamba_ssm: no oracle at ngroups {ngroups}")
