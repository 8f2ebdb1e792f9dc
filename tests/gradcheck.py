"""Central finite differences in float64, for checking hand-written backward passes.

    check_grad(f, x, analytic) -> max relative error, where f() reads x (perturbed in place) and returns a float.
"""

import numpy as np


def numeric_grad(f, x, index, eps=1e-5):
    """(f(x + eps e_i) - f(x - eps e_i)) / 2 eps for each flat index i; x is restored afterwards."""
    flat = x.reshape(-1)  # a view: x must be contiguous
    out = np.empty(len(index))
    for j, i in enumerate(index):
        old = flat[i]
        flat[i] = old + eps
        up = f()
        flat[i] = old - eps
        down = f()
        flat[i] = old
        out[j] = (up - down) / (2 * eps)
    return out


def rel_error(a, b):
    """max |a - b| / max(|a|, |b|) over the whole tensor (a norm-wise relative error)."""
    scale = max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0))
    return float(np.abs(a - b).max(initial=0.0) / scale) if scale > 0 else 0.0


def check_grad(f, x, analytic, max_elems=None, rng=None, eps=1e-5):
    """Max relative error of `analytic` (shaped as x) against finite differences of f w.r.t. x.

    With max_elems, only a random subset of that many elements is perturbed.
    """
    assert x.dtype == np.float64 and x.flags.c_contiguous and analytic.shape == x.shape
    index = np.arange(x.size)
    if max_elems is not None and x.size > max_elems:
        index = (rng or np.random.default_rng(0)).choice(x.size, max_elems, replace=False)
    return rel_error(analytic.reshape(-1)[index], numeric_grad(f, x, index, eps))


def lm_grad_errors(params, cfg, L, eps, seed=0, batch=2):
    """Finite-difference error of the reference LM's backward for every parameter (name -> max rel error),
    on random tokens; also checks the parameter set, shapes and a finite loss."""
    from mambactl.models.params import parameter_specs
    from mambactl.reference.lm import lm_backward, lm_forward

    assert set(params) == {s.name for s in parameter_specs(cfg)}
    rng = np.random.default_rng(seed + 10)
    ids = rng.integers(0, cfg.vocab_size, size=(batch, L))
    targets = np.concatenate([ids[:, 1:], np.full((batch, 1), -100)], axis=1)
    logits, loss, saved = lm_forward(params, cfg, ids, targets)
    assert logits.shape == (batch, L, cfg.padded_vocab_size) and np.isfinite(loss)
    grads = lm_backward(params, cfg, saved)
    assert set(grads) == set(params) and all(grads[k].shape == params[k].shape for k in params)
    f = lambda: lm_forward(params, cfg, ids, targets)[1]  # noqa: E731
    return {k: check_grad(f, params[k], grads[k], eps=eps) for k in params}
