"""The SSD scan (state space duality), as mamba_ssm's `ssd_minimal_discrete` (chunked) and as a plain loop.

The core (`ssd_chunked`, kernels/ssd.wgsl's `ssd_chunked` / ops/ssd.py): per batch and head, with a per-step
log-decay adt [b, l, h] (≤ 0) and input scale [b, l, h] given directly,

    state_t = exp(adt_t) state_{t-1} + scale_t x_t ⊗ B_t,     y_t = state_t C_t (+ D x_t)

optionally with a per-step diagonal weight diag [b, l, h] that replaces scale_t in step t's own output:
y_t = exp(adt_t) state_{t-1} C_t + diag_t (B_t·C_t) x_t (+ D x_t) — the state still takes scale_t. Mamba-3
SISO is this with scale = γ + δ_{t+1} and diag = γ (mambactl/reference/mamba3.py's fold).

Mamba-2 (`ssd`, `ssd_backward`) is the core with scale = Δ (already softplus(dt + dt_bias), clamped) and
adt = Δ A (A = -exp(A_log) < 0): mamba_ssm's Euler discretisation B̄ = Δ B, no D term, no gate.
Shapes: x [b, l, h, p]; B, C [b, l, g, n] with g groups, head h reading group h // (h_count / g) (mamba_ssm /
HF `repeat_interleave`); state [b, h, p, n] per batch and head.

`ssd_chunked` computes it in chunks of `chunk_size` steps, in the four steps of ssd_minimal (Listing 1):
1. within each chunk, y_diag = (C Bᵀ ∘ L) X — a masked "attention" with decay L[i, j] = exp(Σ_{j<k<=i} adt_k);
2. the state each chunk adds by its end; 3. the chunk-to-chunk recurrence of those states, from a zero state;
4. y_off = the state entering each chunk, read out by C and decayed to each position.
The sequence is padded with zeros to a multiple of the chunk (scale = adt = 0 there) and cropped.
"""

import numpy as np


def _heads(BC, nheads):
    """[b, l, g, n] -> [b, l, h, n]: each group serves nheads / g consecutive heads."""
    return np.repeat(BC, nheads // BC.shape[2], axis=2)


def _groups(dBC, ngroups):
    """The adjoint of `_heads`: [b, l, h, n] -> [b, l, g, n], summing each group's heads."""
    b, l, h, n = dBC.shape
    return dBC.reshape(b, l, ngroups, h // ngroups, n).sum(axis=3)


def segsum(a):
    """a [..., T] -> [..., T, T] with out[..., i, j] = Σ_{k=j+1..i} a_k for i >= j and -inf above the diagonal.

    The stable form of ssd_minimal: cumulative sums of a masked copy, no differences of large cumsums.
    """
    T = a.shape[-1]
    lower = np.tri(T, dtype=bool)  # i >= j
    x = np.where(np.tri(T, k=-1, dtype=bool), a[..., :, None], 0.0)  # x[..., i, j] = a_i for i > j
    return np.where(lower, np.cumsum(x, axis=-2), -np.inf)


def _diag_terms(x, scale, B, C, diag):
    """(e, bc) [b, l, h]: e = scale − diag (what the diagonal weight takes away from step t's own term) and
    bc = B_t·C_t of each head's group."""
    h = x.shape[2]
    return scale - diag, np.einsum("blhn,blhn->blh", _heads(B, h), _heads(C, h))


def ssd_chunked(x, adt, scale, B, C, chunk_size, D=None, diag=None):
    """The SSD core -> y [b, l, h, p], chunked: state_t = exp(adt_t) state_{t-1} + scale_t x_t ⊗ B_t,
    y_t = state_t C_t (+ D x_t when D [h] is given), from a zero state; with diag [b, l, h] step t's own term
    in y_t is weighted by diag_t instead of scale_t. adt, scale [b, l, h] (adt ≤ 0, the per-step log-decay).
    Mamba-2: scale = Δ, adt = Δ A (`ssd`); ssd_minimal_discrete with X = x·scale, A = adt."""
    b, l, h, p = x.shape
    Q = chunk_size
    pad = -l % Q
    X = x * scale[..., None]
    Adt = adt  # [b, l, h]
    Bh, Ch = _heads(B, h), _heads(C, h)
    if pad:
        X, Adt, Bh, Ch = (np.concatenate([t, np.zeros((b, pad) + t.shape[2:])], axis=1) for t in (X, Adt, Bh, Ch))
    c = (l + pad) // Q
    # Rearrange into chunks: X [b, c, Q, h, p], Adt [b, h, c, Q], B/C [b, c, Q, h, n].
    X, Bh, Ch = (t.reshape((b, c, Q) + t.shape[2:]) for t in (X, Bh, Ch))
    Adt = Adt.reshape(b, c, Q, h).transpose(0, 3, 1, 2)
    A_cumsum = np.cumsum(Adt, axis=-1)

    # 1. Output within each chunk (diagonal blocks).
    L = np.exp(segsum(Adt))  # [b, h, c, Q(l), Q(s)]
    Y_diag = np.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Ch, Bh, L, X)

    # 2. The state each chunk adds by its last step (B terms).
    decay_states = np.exp(A_cumsum[..., -1:] - A_cumsum)  # [b, h, c, Q]
    states = np.einsum("bclhn,bhcl,bclhp->bchpn", Bh, decay_states, X)

    # 3. Chunk-to-chunk recurrence from a zero initial state: the state entering every chunk (A terms).
    states = np.concatenate([np.zeros_like(states[:, :1]), states], axis=1)  # [b, c + 1, h, p, n]
    chunk_decay = np.concatenate([np.zeros((b, h, 1)), A_cumsum[..., -1]], axis=-1)  # Σ adt of each chunk
    decay_chunk = np.exp(segsum(chunk_decay))  # [b, h, c + 1, c + 1]
    new_states = np.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states = new_states[:, :-1]  # entering chunks 0..c-1; new_states[:, -1] is the final state

    # 4. State -> output within each chunk (C terms).
    Y_off = np.einsum("bclhn,bchpn,bhcl->bclhp", Ch, states, np.exp(A_cumsum))

    y = (Y_diag + Y_off).reshape(b, c * Q, h, p)[:, :l]
    if diag is not None:
        e, bc = _diag_terms(x, scale, B, C, diag)
        y = y - (e * bc)[..., None] * x
    return y if D is None else y + D[:, None] * x


def ssd_chunked_backward(x, adt, scale, B, C, dy, D=None, diag=None):
    """dy [b, l, h, p] -> (dx, dadt, dscale, dB, dC, dD, ddiag) of `ssd_chunked`, shaped as x, adt, scale, B,
    C, D, diag (dD None without D, ddiag None without diag). Exact.

    Recomputes every state, then runs the adjoint recurrence backwards in time:
    g_t = ∂loss/∂state_t = dy_t ⊗ C_t + exp(adt_{t+1}) g_{t+1}. Then
    dx_t = scale_t g_t B_t (+ D dy_t),  dscale_t = x_t·(g_t B_t),  dadt_t = exp(adt_t) ⟨g_t, state_{t-1}⟩,
    dB_t = Σ_heads scale_t g_tᵀ x_t,  dC_t = Σ_heads state_tᵀ dy_t,  dD = Σ_{b,t,p} dy·x.
    """
    b, l, h, p = x.shape
    G = B.shape[2]
    Bh, Ch = _heads(B, h), _heads(C, h)
    decay = np.exp(adt)  # [b, l, h]
    states = [np.zeros((b, h, p, B.shape[-1]))]  # states[t + 1] = state_t
    for t in range(l):
        states.append(decay[:, t, :, None, None] * states[-1]
                      + (scale[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :])
    dx, dadt, dscale = np.zeros_like(x), np.zeros_like(adt), np.zeros_like(scale)
    dBh, dCh = np.zeros_like(Bh), np.zeros_like(Ch)
    g = np.zeros_like(states[0])
    for t in reversed(range(l)):
        dCh[:, t] = np.einsum("bhpn,bhp->bhn", states[t + 1], dy[:, t])
        g = g + dy[:, t, :, :, None] * Ch[:, t, :, None, :]
        gB = np.einsum("bhpn,bhn->bhp", g, Bh[:, t])  # ∂loss/∂(scale_t x_t)
        dx[:, t] = gB * scale[:, t, :, None]
        dBh[:, t] = np.einsum("bhpn,bhp->bhn", g, scale[:, t, :, None] * x[:, t])
        dscale[:, t] = np.sum(gB * x[:, t], axis=-1)
        dadt[:, t] = decay[:, t] * np.einsum("bhpn,bhpn->bh", g, states[t])
        g = g * decay[:, t, :, None, None]
    dD = ddiag = None
    if diag is not None:  # y_t −= e_t (B_t·C_t) x_t
        e, bc = _diag_terms(x, scale, B, C, diag)
        xdy = np.sum(x * dy, axis=-1)
        dx = dx - (e * bc)[..., None] * dy
        dBh = dBh - (e * xdy)[..., None] * Ch
        dCh = dCh - (e * xdy)[..., None] * Bh
        ddiag = bc * xdy
        dscale = dscale - ddiag
    if D is not None:
        dx = dx + D[:, None] * dy
        dD = np.sum(dy * x, axis=(0, 1, 3))
    return dx, dadt, dscale, _groups(dBh, G), _groups(dCh, G), dD, ddiag


def ssd(x, dt, A, B, C, chunk_size):
    """Mamba-2's scan -> y [b, l, h, p]: the core with scale = Δ = dt and adt = Δ A (no D term)."""
    return ssd_chunked(x, dt * A, dt, B, C, chunk_size)


def ssd_sequential(x, dt, A, B, C):
    """-> y [b, l, h, p] by the plain recurrence, one step at a time (the second oracle)."""
    b, l, h, p = x.shape
    Bh, Ch = _heads(B, h), _heads(C, h)
    state = np.zeros((b, h, p, B.shape[-1]))
    y = np.zeros_like(x)
    for t in range(l):
        state = (np.exp(dt[:, t] * A)[:, :, None, None] * state
                 + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :])
        y[:, t] = np.einsum("bhpn,bhn->bhp", state, Ch[:, t])
    return y


def ssd_backward(x, dt, A, B, C, dy):
    """dy [b, l, h, p] -> (dx, ddt, dA, dB, dC) of `ssd`, shaped as x, dt, A, B, C: the core's gradients
    through scale = Δ and adt = Δ A, so ∂/∂Δ = dscale + A dadt and ∂/∂A = Σ_{b,t} Δ dadt."""
    dx, dadt, dscale, dB, dC, _, _ = ssd_chunked_backward(x, dt * A, dt, B, C, dy)
    return dx, dscale + A * dadt, np.sum(dt * dadt, axis=(0, 1)), dB, dC
