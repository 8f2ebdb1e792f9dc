"""Mamba-1 selective scan (S6), as mamba_ssm's `selective_scan_ref`, in time-major layout.

Shapes: u, delta, z [B, L, D]; A [D, N]; B, C [B, L, N]; D [D]; state h [B, D, N]. `delta` is already
softplus(dt + dt_bias). Discretisation is mamba_ssm's: Ā = exp(Δ A), B̄u = Δ B u (Euler, not exact ZOH).

    h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t u_t,   y_t = C_t · h_t + D u_t,   out_t = y_t · SiLU(z_t)
"""

import numpy as np

from mambactl.reference.activations import silu, silu_backward


def selective_scan_step(state, u_t, delta_t, A, B_t, C_t, D, z_t=None):
    """One time step: state [B, D, N], u_t, delta_t, z_t [B, D], B_t, C_t [B, N] -> (y_t [B, D], new state)."""
    state = np.exp(delta_t[:, :, None] * A) * state + (delta_t * u_t)[:, :, None] * B_t[:, None, :]
    y_t = np.einsum("bdn,bn->bd", state, C_t) + D * u_t
    return (y_t if z_t is None else y_t * silu(z_t)), state


def selective_scan(u, delta, A, B, C, D, z=None):
    """-> y [B, L, D], the sequential scan from a zero state."""
    h = np.zeros((u.shape[0], u.shape[2], A.shape[1]))
    ys = []
    for t in range(u.shape[1]):
        y_t, h = selective_scan_step(h, u[:, t], delta[:, t], A, B[:, t], C[:, t], D, None if z is None else z[:, t])
        ys.append(y_t)
    return np.stack(ys, axis=1)


def selective_scan_backward(u, delta, A, B, C, D, z, dy):
    """dy [B, L, D] -> (du, ddelta, dA, dB, dC, dD, dz); dz is None when z is None.

    Recomputes every state h_t, then runs the adjoint recurrence backwards in time:
    g_t = ∂loss/∂h_t = C_t dy'_t + exp(Δ_{t+1} A) g_{t+1}, where dy' is dy through the gate.
    """
    Bsz, L, Dc = u.shape
    hs = [np.zeros((Bsz, Dc, A.shape[1]))]  # hs[t + 1] = h_t
    for t in range(L):
        hs.append(np.exp(delta[:, t, :, None] * A) * hs[-1] + (delta[:, t] * u[:, t])[:, :, None] * B[:, t, None, :])
    if z is None:
        dz = None
    else:
        dz = silu_backward(z, dy * selective_scan(u, delta, A, B, C, D))
        dy = dy * silu(z)
    du, ddelta, dA, dB, dC = D * dy, np.zeros_like(delta), np.zeros_like(A), np.zeros_like(B), np.zeros_like(C)
    dD = np.sum(dy * u, axis=(0, 1))
    g = np.zeros_like(hs[0])
    for t in reversed(range(L)):
        dC[:, t] = np.einsum("bdn,bd->bn", hs[t + 1], dy[:, t])
        g = g + dy[:, t, :, None] * C[:, t, None, :]
        A_bar = np.exp(delta[:, t, :, None] * A)
        g_dA = g * hs[t] * A_bar  # ∂loss/∂(Δ A) through Ā_t = exp(Δ_t A)
        gB = np.einsum("bdn,bn->bd", g, B[:, t])  # ∂loss/∂(Δ_t u_t)
        ddelta[:, t] = np.einsum("bdn,dn->bd", g_dA, A) + gB * u[:, t]
        dA += np.einsum("bdn,bd->dn", g_dA, delta[:, t])
        du[:, t] += gB * delta[:, t]
        dB[:, t] = np.einsum("bdn,bd->bn", g, delta[:, t] * u[:, t])
        g = g * A_bar
    return du, ddelta, dA, dB, dC, dD, dz
