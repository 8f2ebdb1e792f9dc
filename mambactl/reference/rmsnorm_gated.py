"""Mamba-2's gated, grouped RMSNorm (mamba_ssm `RMSNormGated` with norm_before_gate=False, `rms_norm_ref`;
HF `MambaRMSNormGated`):

    u = y · SiLU(z);   out = u / sqrt(mean_group(u²) + eps) · w

The mean runs over each group of `group_size` consecutive channels (group_size = d_inner / ngroups), not over the
whole row; with ngroups = 1 it is a plain RMSNorm of the gated input.
"""

import numpy as np

from mambactl.reference.activations import silu, silu_backward


def _grouped(t, group_size):
    """[..., D] -> [..., D / group_size, group_size] (a view)."""
    return t.reshape(t.shape[:-1] + (t.shape[-1] // group_size, group_size))


def rmsnorm_gated(y, z, w, group_size, eps=1e-5):
    """y, z [..., D], w [D] -> [..., D]."""
    u = _grouped(y * silu(z), group_size)
    r = 1.0 / np.sqrt(np.mean(u * u, axis=-1, keepdims=True) + eps)
    return (u * r).reshape(y.shape) * w


def rmsnorm_gated_backward(y, z, w, group_size, dy, eps=1e-5):
    """-> (dy_in [..., D], dz [..., D], dw [D])."""
    u = _grouped(y * silu(z), group_size)
    r = 1.0 / np.sqrt(np.mean(u * u, axis=-1, keepdims=True) + eps)
    g = _grouped(dy * w, group_size)
    du = (r * g - u * r**3 * np.sum(g * u, axis=-1, keepdims=True) / group_size).reshape(y.shape)
    dw = np.sum(dy * (u * r).reshape(y.shape), axis=tuple(range(y.ndim - 1)))
    return du * silu(z), silu_backward(z, du * y), dw
