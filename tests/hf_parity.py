"""Running the float64 reference LM and a transformers model with the same weights (test-only; needs torch)."""

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
