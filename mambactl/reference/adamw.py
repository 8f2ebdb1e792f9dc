"""AdamW: the float64 reference and CPU mirror of the GPU optimizer kernel (one parameter tensor per call).

Per element, for update number `step` (1-based; the bias corrections use it):
    g     = grad · grad_scale                      (grad_scale = clip_scale(global norm, grad_clip))
    m'    = β1·m + (1 − β1)·g
    v'    = β2·v + (1 − β2)·g²
    step  = lr · (m' / (1 − β1^t)) / (sqrt(v' / (1 − β2^t)) + eps)
    step  = clamp(step, −max_delta, max_delta)     (trust region; max_delta = 0 disables it)
    θ'    = θ·(1 − lr·wd) − step                   (decoupled decay, not clamped)
Guard: where g, m', v' or the (clamped) step is not finite, θ, m and v keep their old values and the element is
counted. With the trust region on, an infinite step is clamped to ±max_delta like any other; a NaN one stays bad.
A step whose global gradient norm is not finite is skipped entirely by the caller; this guard is per element.
"""

from __future__ import annotations

import math

import numpy as np

from mambactl.errors import ShapeError


def clip_scale(global_norm: float, max_norm: float) -> float:
    """The gradient multiplier of global-norm clipping: min(1, max_norm / global_norm); 1 when max_norm is 0.

    `global_norm` = sqrt(Σ over all parameters of Σ g²) and must be finite (the caller skips the step if not).
    """
    if not math.isfinite(global_norm):
        raise ValueError(f"global gradient norm {global_norm} is not finite; skip the step instead")
    if max_norm <= 0 or global_norm <= max_norm:
        return 1.0
    return max_norm / global_norm


def adamw_step(param, grad, m, v, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, grad_scale: float = 1.0, max_delta: float = 0.0):
    """param, grad, m, v: arrays of one shape -> (param', m', v', n_bad); new float64 arrays, inputs untouched.

    n_bad: the number of elements the NaN/Inf guard left unchanged.
    """
    param, grad, m, v = (np.asarray(a, dtype=np.float64) for a in (param, grad, m, v))
    if not grad.shape == m.shape == v.shape == param.shape:
        raise ShapeError(f"adamw_step: param {param.shape}, grad {grad.shape}, m {m.shape}, v {v.shape} differ")
    if step < 1:
        raise ValueError(f"adamw_step: step is 1-based, got {step}")
    with np.errstate(over="ignore", invalid="ignore"):
        g = grad * grad_scale
        m_new = beta1 * m + (1 - beta1) * g
        v_new = beta2 * v + (1 - beta2) * g * g
        m_hat = m_new / (1 - beta1**step)
        v_hat = v_new / (1 - beta2**step)
        delta = lr * m_hat / (np.sqrt(v_hat) + eps)
        if max_delta > 0:
            delta = np.clip(delta, -max_delta, max_delta)
        p_new = param * (1 - lr * weight_decay) - delta
    ok = np.isfinite(g) & np.isfinite(m_new) & np.isfinite(v_new) & np.isfinite(delta)
    return (np.where(ok, p_new, param), np.where(ok, m_new, m), np.where(ok, v_new, v), int(ok.size - ok.sum()))
