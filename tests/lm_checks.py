"""Checks shared by the GPU language-model tests: weights with no trivial gradients, the comparison with
the float64 reference LM, and a short overfitting run."""

import numpy as np

from mambactl.models.lm import LanguageModel
from mambactl.models.params import init_parameters, parameter_specs
from mambactl.ops.adamw import AdamWState, adamw_step
from mambactl.reference.lm import lm_backward, lm_forward

OVERFIT_TEXT = "the quick brown fox jumps over the lazy dog"


def random_weights(cfg, seed):
    """The init plus noise everywhere, so no gradient is trivially zero or one; Δ biases ~ N(0, 1) so the
    scans see step sizes near 1, where every path of the gradient matters."""
    rng = np.random.default_rng(seed)
    w = init_parameters(cfg, seed)
    for k, v in w.items():
        w[k] = (v + 0.1 * rng.standard_normal(v.shape) * (1 + np.abs(v).mean())).astype(np.float32)
        if k.endswith("dt_proj.bias") or k.endswith("dt_bias"):
            w[k] = rng.normal(0, 1, v.shape).astype(np.float32)
    return w


def rel(gpu, ref):
    """‖gpu − ref‖ / ‖ref‖, after checking no element is NaN (poisoned and never written) or infinite."""
    gpu = np.asarray(gpu, np.float64)
    assert np.all(np.isfinite(gpu)), "unwritten (NaN-poisoned) or non-finite elements in the GPU output"
    return np.linalg.norm(gpu - ref) / np.linalg.norm(ref)


def assert_lm_matches_reference(rt, cfg, batch, length, seed=1):
    """GPU logits and loss within 1e-4 and every parameter gradient within 1e-3 of the float64 reference."""
    rng = np.random.default_rng(seed)
    weights = random_weights(cfg, seed + 1)
    ids = rng.integers(0, cfg.vocab_size, (batch, length))
    targets = np.concatenate([ids[:, 1:], np.full((batch, 1), -100)], axis=1)

    lm = LanguageModel(cfg, rt, weights)
    loss, logits, saved = lm.forward(ids, targets)
    lm.backward(saved)

    w64 = {k: v.astype(np.float64) for k, v in weights.items()}
    ref_logits, ref_loss, ref_saved = lm_forward(w64, cfg, ids, targets)
    ref_grads = lm_backward(w64, cfg, ref_saved)

    assert rel(logits.numpy(), ref_logits.reshape(batch * length, -1)) < 1e-4
    assert rel(loss.numpy(), [ref_loss]) < 1e-4
    grads = lm.grads_numpy()
    assert set(grads) == set(ref_grads)
    for k, g in ref_grads.items():
        assert rel(grads[k], g) < 1e-3, k


def overfit_losses(rt, cfg, steps, lr=1e-2):
    """(first, last) loss of `steps` AdamW steps on OVERFIT_TEXT (characters mod the vocabulary)."""
    lm = LanguageModel(cfg, rt, init_parameters(cfg, 0))
    specs = parameter_specs(cfg)
    params = [lm.params[s.name] for s in specs]
    grads = [lm.grads[s.name] for s in specs]
    opt = AdamWState.zeros(params)
    seq = np.array([[ord(c) % cfg.vocab_size for c in OVERFIT_TEXT]])
    ids, targets = seq[:, :-1], seq[:, 1:]
    losses = []
    for _ in range(steps):
        lm.zero_grad()
        loss, _, saved = lm.forward(ids, targets)
        lm.backward(saved)
        adamw_step(params, grads, opt, lr=lr, no_decay=[s.no_decay for s in specs], weight_decay=0.1,
                   max_grad_norm=1.0)
        losses.append(loss)
    return float(losses[0].numpy()[0]), float(losses[-1].numpy()[0])
