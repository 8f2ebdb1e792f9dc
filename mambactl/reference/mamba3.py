"""Mamba-3 mixer (mamba_ssm `Mamba3`, SISO and MIMO) and its hand-written backward.

    [z, x, B, C, dd_dt, dd_A, trap, angle] = in_proj(u)            (no conv, no biases)
    Δ = softplus(dd_dt + dt_bias);  A = −max(heavy_tail(dd_A), A_floor);  λ = sigmoid(trap)
    α = exp(Δ A),  β = (1 − λ) Δ α,  γ = λ Δ                        (per token and head)
    θ_t = θ_{t−1} + Δ_t π tanh(angle_t)                             (angles shared by heads, Δ per head)
    k = rot(θ, RMSNorm(B) + B_bias),  q = rot(θ, RMSNorm(C) + C_bias),  v_r = mimo_x_r ⊙ x
    h_t = α_t h_{t−1} + β_t Σ_r v_{t−1,r} k_{t−1,r}ᵀ + γ_t Σ_r v_{t,r} k_{t,r}ᵀ       (exponential-trapezoidal)
    y_r = h q_r + D v_r;  o_r = f(y_r) ⊙ SiLU(mimo_z_r ⊙ z);  out = out_proj(Σ_r mimo_o_r ⊙ o_r)

f is the identity, or with `is_outproj_norm` an RMSNorm over each head's channels times norm.weight
(mamba_ssm's RMSNormGated(norm_before_gate=True, group_size=headdim)). SISO is rank R = 1 with
mimo_x = mimo_z = mimo_o = 1 (no such parameters). B and C come in `ngroups` groups per rank, head h reading
group h // (H / G). The rotation turns state dims (i0[j], i1[j]) by θ_j for j < S = num_rope_angles and leaves
the rest: pairs (2j, 2j + 1) for SISO (mamba3_siso_step_ref), (j, j + N/2) for MIMO (what mamba_ssm's MIMO
module runs: its TileLang kernels and `rotate_pairwise = not is_mimo` in `Mamba3.step`). θ is not reduced
mod 2π (mamba_ssm does, to keep float32 angles small; cos and sin are the same). heavy_tail(x) = 1 + x for
x >= 0, 1 / (1 − x) below: mamba_ssm's A since commit c69aaab (2026-06; −softplus(dd_A) before).

Internal shapes: q, k [b, l, H, R, N]; v and scan outputs [b, l, H, R, P]; Δ, A·Δ, λ [b, l, H];
θ [b, l, H, S]; scan state h [b, H, P, N]. `params` holds one mixer's tensors under their names without the
layer prefix ("in_proj.weight", "dt_bias", "B_bias", "C_bias" [H, R, N], "B_norm.weight", "C_norm.weight" [N],
"D" [H], "mimo_x", "mimo_z", "mimo_o" [H, R, P] (MIMO), "norm.weight" [d_inner] (out-norm), "out_proj.weight");
the grads use the same names.
"""

import numpy as np

from mambactl.reference.activations import (sigmoid, sigmoid_backward, silu, silu_backward, softplus,
                                            softplus_backward)
from mambactl.reference.linear import linear, linear_backward
from mambactl.reference.rmsnorm import rmsnorm, rmsnorm_backward
from mambactl.reference.slice import column_concat
from mambactl.reference.ssd import segsum

NORM_EPS = 1e-5  # B_norm, C_norm and the out-norm (fixed in mamba_ssm)


# --- elementwise pieces ---------------------------------------------------------------------------------------------


def heavy_tail(x):
    """1 + x for x >= 0, 1 / (1 − x) for x < 0: positive, C¹, linear growth up and a slow decay down."""
    return np.where(x >= 0, 1.0 + x, 1.0 / (1.0 - np.minimum(x, 0.0)))


def heavy_tail_backward(x, dy):
    return dy * np.where(x >= 0, 1.0, 1.0 / (1.0 - np.minimum(x, 0.0)) ** 2)


def _next(a):
    """a [b, l, ...] -> a_{t+1}, zero after the last step."""
    return np.concatenate([a[:, 1:], np.zeros_like(a[:, :1])], axis=1)


# --- the rotation ----------------------------------------------------------------------------------------------------


def rope_pairs(cfg):
    """(i0, i1) [S]: the state dims that angle j rotates together."""
    j = np.arange(cfg.mamba3_num_rope_angles)
    return (j, j + cfg.mamba3.d_state // 2) if cfg.mamba3.is_mimo else (2 * j, 2 * j + 1)


def rotate(x, theta, pairs):
    """x [b, l, H, R, N], θ [b, l, H, S] -> x with (x_i0, x_i1) turned by θ (the same for every rank)."""
    i0, i1 = pairs
    c, s = np.cos(theta)[:, :, :, None], np.sin(theta)[:, :, :, None]
    x0, x1 = x[..., i0], x[..., i1]
    out = x.copy()
    out[..., i0] = x0 * c - x1 * s
    out[..., i1] = x0 * s + x1 * c
    return out


def rotate_backward(out, theta, pairs, dout):
    """Given out = rotate(x, θ) -> (dx, dθ [b, l, H, S]): dx is dout turned by −θ; ∂out0/∂θ = −out1, ∂out1/∂θ = out0."""
    i0, i1 = pairs
    c, s = np.cos(theta)[:, :, :, None], np.sin(theta)[:, :, :, None]
    d0, d1 = dout[..., i0], dout[..., i1]
    dx = dout.copy()
    dx[..., i0] = d0 * c + d1 * s
    dx[..., i1] = d1 * c - d0 * s
    return dx, np.sum(d1 * out[..., i0] - d0 * out[..., i1], axis=3)


# --- the scan --------------------------------------------------------------------------------------------------------


def mamba3_scan_step(state, q, k, v, adt, dt, lam):
    """One step of the recurrence in mamba3_siso_step_ref / mamba3_MIMO_step_ref's form.

    state = (h [b, H, P, N], k_prev [b, H, R, N], v_prev [b, H, R, P]), zeros before the first token;
    q, k [b, H, R, N]; v [b, H, R, P]; adt = A·Δ, dt = Δ, lam = λ [b, H] -> (y [b, H, R, P] = h q, new state).
    """
    h, k_prev, v_prev = state
    alpha = np.exp(adt)
    beta, gamma = (1 - lam) * dt * alpha, lam * dt
    h = (alpha[..., None, None] * h + beta[..., None, None] * np.einsum("bhrp,bhrn->bhpn", v_prev, k_prev)
         + gamma[..., None, None] * np.einsum("bhrp,bhrn->bhpn", v, k))
    return np.einsum("bhpn,bhRn->bhRp", h, q), (h, k, v)


def mamba3_scan_sequential(q, k, v, adt, dt, lam):
    """-> y [b, l, H, R, P] by `mamba3_scan_step` from a zero state (the second oracle)."""
    b, l, H, R, P = v.shape
    state = (np.zeros((b, H, P, q.shape[-1])), np.zeros_like(k[:, 0]), np.zeros_like(v[:, 0]))
    ys = []
    for t in range(l):
        y, state = mamba3_scan_step(state, q[:, t], k[:, t], v[:, t], adt[:, t], dt[:, t], lam[:, t])
        ys.append(y)
    return np.stack(ys, axis=1)


# --- the SISO fold into a Mamba-2 SSD (kernels/mamba3_fold.wgsl) ------------------------------------------------


def mamba3_fold_scale(dt, lam):
    """Δ, λ [b, l, H] -> (s, d): the SSD core's input scale s_t = λ_t Δ_t + δ_{t+1}, δ_t = (1 − λ_t) Δ_t (0 after
    the last step), and its diagonal weight d_t = γ_t = λ_t Δ_t.

    With them the recurrence is g_t = exp(adt_t) g_{t−1} + s_t Σ_r v_{t,r} k_{t,r}ᵀ and
    h_t = g_t − δ_{t+1} u_t = exp(adt_t) g_{t−1} + d_t u_t, so y_t = h_t q_t is the core's output with diag = d
    (mambactl/reference/ssd.py's `ssd_chunked`)."""
    return lam * dt + _next((1 - lam) * dt), lam * dt


def mamba3_fold_backward(dt, lam, dscale, ddiag):
    """The adjoint of `mamba3_fold_scale`: the core's ∂loss/∂scale and ∂loss/∂diag [b, l, H] -> (ddt, dlam).
    s_t = λ_t Δ_t + (1 − λ_{t+1}) Δ_{t+1} and d_t = λ_t Δ_t, so with D_t = dscale_{t−1} (0 at t = 0):
    ∂/∂Δ_t = λ_t (dscale_t + ddiag_t) + (1 − λ_t) D_t and ∂/∂λ_t = Δ_t (dscale_t + ddiag_t − D_t)."""
    prev = np.concatenate([np.zeros_like(dscale[:, :1]), dscale[:, :-1]], axis=1)
    own = dscale + ddiag
    return lam * own + (1 - lam) * prev, dt * (own - prev)


def mamba3_scan(q, k, v, adt, dt, lam, chunk_size):
    """-> y [b, l, H, R, P] = h_t q_t, in chunks of `chunk_size` steps (as mamba3_siso_fwd_ref, chunked).

    Folding β_{t+1}'s term into step t gives a Mamba-2 (SSD) recurrence g_t = α_t g_{t−1} + s_t u_t with
    u_t = Σ_r v_{t,r} k_{t,r}ᵀ, s_t = γ_t + δ_{t+1}, δ_t = (1 − λ_t) Δ_t (δ_l = 0), and h_t = g_t − δ_{t+1} u_t.
    g is computed as ssd_minimal does (intra-chunk masked "attention", chunk states, chunk-to-chunk
    recurrence, state readout); the last term is the diagonal correction −δ_{t+1} Σ_r v_{t,r} (k_{t,r} · q_t).
    The sequence is padded with zeros to a multiple of the chunk (no decay, no input) and cropped.
    """
    b, l, H, R, P = v.shape
    Q = chunk_size
    delta = _next((1 - lam) * dt)
    ks = k * mamba3_fold_scale(dt, lam)[0][..., None, None]
    corr = delta[..., None, None] * np.einsum("blhRr,blhrp->blhRp", np.einsum("blhRn,blhrn->blhRr", q, k), v)
    pad = -l % Q
    if pad:
        q, ks, v, adt = (np.concatenate([t, np.zeros((b, pad) + t.shape[2:])], axis=1) for t in (q, ks, v, adt))
    c = (l + pad) // Q
    q, ks, v = (t.reshape((b, c, Q) + t.shape[2:]) for t in (q, ks, v))  # [b, c, Q, H, R, ·]
    a = adt.reshape(b, c, Q, H).transpose(0, 3, 1, 2)  # [b, H, c, Q]
    a_cum = np.cumsum(a, axis=-1)

    # 1. Within each chunk: y_l = Σ_{s<=l} exp(a_{s+1} + .. + a_l) Σ_r (q_l · k_{s,r}) s_s v_{s,r}.
    scores = np.einsum("bclhRn,bcshrn->bhclsRr", q, ks) * np.exp(segsum(a))[..., None, None]
    y_diag = np.einsum("bhclsRr,bcshrp->bclhRp", scores, v)
    # 2. The state each chunk adds by its end.
    decay_states = np.exp(a_cum[..., -1:] - a_cum).transpose(0, 2, 3, 1)  # [b, c, Q, H]
    states = np.einsum("bcshrn,bcshrp->bchpn", ks * decay_states[..., None, None], v)
    # 3. The state entering every chunk, from a zero state.
    states = np.concatenate([np.zeros_like(states[:, :1]), states], axis=1)
    chunk_decay = np.exp(segsum(np.concatenate([np.zeros((b, H, 1)), a_cum[..., -1]], axis=-1)))
    states = np.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)[:, :-1]
    # 4. That state read out at each position, decayed.
    y_off = np.einsum("bclhRn,bchpn->bclhRp", q, states) * np.exp(a_cum).transpose(0, 2, 3, 1)[..., None, None]

    return (y_diag + y_off).reshape(b, c * Q, H, R, P)[:, :l] - corr


def mamba3_scan_backward(q, k, v, adt, dt, lam, dy):
    """dy [b, l, H, R, P] -> (dq, dk, dv, dadt, ddt, dlam), shaped as the inputs. Exact.

    With the SSD form of `mamba3_scan` (g, u, s, δ): the adjoint G_t = ∂loss/∂g_t = Σ_R dy_{t,R} q_{t,R}ᵀ
    + α_{t+1} G_{t+1} runs backwards in time; then dq = h_tᵀ dy, ∂/∂u_t = s_t G_t − δ_{t+1} Σ_R dy q_Rᵀ
    (-> dv, dk), ∂/∂s_t = ⟨G_t, u_t⟩, ∂/∂δ_{t+1} = ∂/∂s_t − ⟨Σ_R dy q_Rᵀ, u_t⟩, ∂/∂(AΔ)_t = α_t ⟨G_t, g_{t−1}⟩.
    """
    l = v.shape[1]
    alpha = np.exp(adt)
    delta = _next((1 - lam) * dt)
    scale = lam * dt + delta
    u = np.einsum("blhrp,blhrn->blhpn", v, k)
    dyq = np.einsum("blhRp,blhRn->blhpn", dy, q)
    g = np.zeros_like(u)  # g[:, t] = g_t
    for t in range(l):
        g[:, t] = scale[:, t, :, None, None] * u[:, t] + (alpha[:, t, :, None, None] * g[:, t - 1] if t else 0.0)
    G = np.zeros_like(u)
    for t in reversed(range(l)):
        G[:, t] = dyq[:, t] + (alpha[:, t + 1, :, None, None] * G[:, t + 1] if t + 1 < l else 0.0)
    h = g - delta[..., None, None] * u
    du = scale[..., None, None] * G - delta[..., None, None] * dyq
    dq = np.einsum("blhpn,blhRp->blhRn", h, dy)
    dk = np.einsum("blhpn,blhrp->blhrn", du, v)
    dv = np.einsum("blhpn,blhrn->blhrp", du, k)
    dscale = np.sum(G * u, axis=(3, 4))
    ddelta_next = dscale - np.sum(dyq * u, axis=(3, 4))  # δ_{t+1}; at t = l − 1 it multiplies a constant 0
    ddelta = np.concatenate([np.zeros_like(dscale[:, :1]), ddelta_next[:, :-1]], axis=1)
    g_prev = np.concatenate([np.zeros_like(g[:, :1]), g[:, :-1]], axis=1)
    dadt = alpha * np.sum(G * g_prev, axis=(3, 4))
    return dq, dk, dv, dadt, dscale * lam + ddelta * (1 - lam), (dscale - ddelta) * dt


# --- the block -------------------------------------------------------------------------------------------------------


def _dims(cfg):
    m = cfg.mamba3
    return (cfg.mamba3_d_inner, cfg.mamba3_nheads, m.headdim, m.ngroups, m.d_state, cfg.mamba3_rank,
            cfg.mamba3_num_rope_angles)


def _mimo(params, cfg):
    """(mimo_x, mimo_z, mimo_o) [H, R, P]; all ones at R = 1 for SISO."""
    if cfg.mamba3.is_mimo:
        return params["mimo_x"], params["mimo_z"], params["mimo_o"]
    one = np.ones((cfg.mamba3_nheads, 1, cfg.mamba3.headdim))
    return one, one, one


def _heads(t, H):
    """[b, l, R, G, N] -> [b, l, H, R, N]: head h reads group h // (H / G)."""
    return np.repeat(t, H // t.shape[3], axis=3).transpose(0, 1, 3, 2, 4)


def _groups(d, G):
    """The adjoint of `_heads`: [b, l, H, R, N] -> [b, l, R, G, N], summing each group's heads."""
    b, l, H, R, N = d.shape
    return d.reshape(b, l, G, H // G, R, N).sum(axis=3).transpose(0, 1, 3, 2, 4)


def _prepare(params, x, cfg, theta0):
    """x [b, l, d_model], θ0 [b, H, S] (the angle carried in) -> dict of the scan inputs and intermediates."""
    b, l, d = x.shape
    di, H, P, G, N, R, S = _dims(cfg)
    x2 = x.reshape(-1, d)
    sizes = [di, di, R * G * N, R * G * N, H, H, H, S]
    z, xs, Bp, Cp, dd_dt, dd_A, trap, ang = np.split(linear(x2, params["in_proj.weight"]), np.cumsum(sizes)[:-1],
                                                     axis=1)
    z, xs = z.reshape(b, l, H, P), xs.reshape(b, l, H, P)
    Bp, Cp = Bp.reshape(b, l, R, G, N), Cp.reshape(b, l, R, G, N)
    dd_dt, dd_A, trap, ang = dd_dt.reshape(b, l, H), dd_A.reshape(b, l, H), trap.reshape(b, l, H), ang.reshape(b, l, S)
    dt_pre = dd_dt + params["dt_bias"]
    dt = softplus(dt_pre)
    A = -np.maximum(heavy_tail(dd_A), cfg.mamba3.A_floor)
    theta = theta0[:, None] + np.cumsum(dt[..., None] * (np.pi * np.tanh(ang))[:, :, None, :], axis=1)
    pairs = rope_pairs(cfg)
    k = rotate(_heads(rmsnorm(Bp, params["B_norm.weight"], NORM_EPS), H) + params["B_bias"], theta, pairs)
    q = rotate(_heads(rmsnorm(Cp, params["C_norm.weight"], NORM_EPS), H) + params["C_bias"], theta, pairs)
    mimo_x, mimo_z, _ = _mimo(params, cfg)
    return dict(x2=x2, z=z, xs=xs, Bp=Bp, Cp=Cp, dt_pre=dt_pre, dt=dt, dd_A=dd_A, A=A, adt=A * dt, trap=trap,
                lam=sigmoid(trap), ang=ang, theta=theta, q=q, k=k, v=xs[:, :, :, None, :] * mimo_x,
                zr=z[:, :, :, None, :] * mimo_z)


def _finish(params, s, ys, cfg):
    """Scan output ys [b, l, H, R, P] -> block output [b, l, d_model]; adds y, yn, o, out to the dict s."""
    di, H, P = cfg.mamba3_d_inner, cfg.mamba3_nheads, cfg.mamba3.headdim
    b, l = ys.shape[:2]
    s["y"] = ys + params["D"][:, None, None] * s["v"]
    s["yn"] = rmsnorm(s["y"], params["norm.weight"].reshape(H, 1, P), NORM_EPS) if cfg.mamba3.is_outproj_norm \
        else s["y"]
    s["o"] = s["yn"] * silu(s["zr"])
    s["out"] = np.sum(s["o"] * _mimo(params, cfg)[2], axis=3).reshape(-1, di)
    return linear(s["out"], params["out_proj.weight"]).reshape(b, l, -1)


def mamba3_block(params, x, cfg):
    """x [B, L, d_model] -> (y [B, L, d_model], saved for the backward). The scan runs chunked."""
    s = _prepare(params, x, cfg, np.zeros((x.shape[0], cfg.mamba3_nheads, cfg.mamba3_num_rope_angles)))
    ys = mamba3_scan(s["q"], s["k"], s["v"], s["adt"], s["dt"], s["lam"], cfg.mamba3.chunk_size)
    return _finish(params, s, ys, cfg), s


def mamba3_init_cache(batch, cfg):
    """The decode state: (θ [B, H, S], h [B, H, P, N], previous k [B, H, R, N], previous v [B, H, R, P]), zeros."""
    _, H, P, _, N, R, S = _dims(cfg)
    return np.zeros((batch, H, S)), np.zeros((batch, H, P, N)), np.zeros((batch, H, R, N)), np.zeros((batch, H, R, P))


def mamba3_step(params, x_t, cache, cfg):
    """One token x_t [B, d_model] -> (y_t [B, d_model], new cache): the recurrent form of `mamba3_block`."""
    theta, h, k_prev, v_prev = cache
    s = _prepare(params, x_t[:, None], cfg, theta)
    ys, (h, k, v) = mamba3_scan_step((h, k_prev, v_prev), s["q"][:, 0], s["k"][:, 0], s["v"][:, 0], s["adt"][:, 0],
                                     s["dt"][:, 0], s["lam"][:, 0])
    return _finish(params, s, ys[:, None], cfg)[:, 0], (s["theta"][:, 0], h, k, v)


def mamba3_block_backward(params, saved, dy, cfg):
    """dy [B, L, d_model] -> (dx [B, L, d_model], grads: dict name -> array, shaped as params)."""
    s = saved
    b, l, d = dy.shape
    di, H, P, G, N, R, S = _dims(cfg)
    m = cfg.mamba3
    mimo_x, mimo_z, mimo_o = _mimo(params, cfg)
    grads = {}
    dout, grads["out_proj.weight"], _ = linear_backward(s["out"], params["out_proj.weight"], dy.reshape(-1, d))
    dout = dout.reshape(b, l, H, 1, P)
    do = dout * mimo_o
    dzr = silu_backward(s["zr"], do * s["yn"])
    dyn = do * silu(s["zr"])
    if m.is_outproj_norm:
        w = params["norm.weight"].reshape(H, 1, P)
        dys = rmsnorm_backward(s["y"], w, dyn, NORM_EPS)[0]
        grads["norm.weight"] = np.sum(dyn * rmsnorm(s["y"], 1.0, NORM_EPS), axis=(0, 1, 3)).reshape(di)
    else:
        dys = dyn
    grads["D"] = np.sum(dys * s["v"], axis=(0, 1, 3, 4))
    dq, dk, dv, dadt, ddt, dlam = mamba3_scan_backward(s["q"], s["k"], s["v"], s["adt"], s["dt"], s["lam"], dys)
    dv = dv + params["D"][:, None, None] * dys
    if m.is_mimo:
        grads["mimo_x"] = np.sum(dv * s["xs"][:, :, :, None, :], axis=(0, 1))
        grads["mimo_z"] = np.sum(dzr * s["z"][:, :, :, None, :], axis=(0, 1))
        grads["mimo_o"] = np.sum(dout * s["o"], axis=(0, 1))
    dxs = np.sum(dv * mimo_x, axis=3)
    dz = np.sum(dzr * mimo_z, axis=3)

    pairs = rope_pairs(cfg)
    dqb, dtheta_q = rotate_backward(s["q"], s["theta"], pairs, dq)
    dkb, dtheta_k = rotate_backward(s["k"], s["theta"], pairs, dk)
    dcum = np.flip(np.cumsum(np.flip(dtheta_q + dtheta_k, axis=1), axis=1), axis=1)  # through θ's cumulative sum
    tanh = np.tanh(s["ang"])
    ddt = ddt + dadt * s["A"] + np.pi * np.sum(dcum * tanh[:, :, None, :], axis=3)
    dang = np.pi * (1 - tanh**2) * np.sum(dcum * s["dt"][..., None], axis=2)
    # torch.clamp passes the gradient where heavy_tail(dd_A) >= A_floor (the bound included).
    ddd_A = heavy_tail_backward(s["dd_A"], -dadt * s["dt"] * (heavy_tail(s["dd_A"]) >= m.A_floor))
    ddt_pre = softplus_backward(s["dt_pre"], ddt)
    grads["dt_bias"] = ddt_pre.sum(axis=(0, 1))
    grads["B_bias"], grads["C_bias"] = dkb.sum(axis=(0, 1)), dqb.sum(axis=(0, 1))
    dBp, grads["B_norm.weight"] = rmsnorm_backward(s["Bp"], params["B_norm.weight"], _groups(dkb, G), NORM_EPS)
    dCp, grads["C_norm.weight"] = rmsnorm_backward(s["Cp"], params["C_norm.weight"], _groups(dqb, G), NORM_EPS)
    M = b * l
    dproj = column_concat([dz.reshape(M, di), dxs.reshape(M, di), dBp.reshape(M, -1), dCp.reshape(M, -1),
                           ddt_pre.reshape(M, H), ddd_A.reshape(M, H), sigmoid_backward(s["trap"], dlam).reshape(M, H),
                           dang.reshape(M, S)])
    dx, grads["in_proj.weight"], _ = linear_backward(s["x2"], params["in_proj.weight"], dproj)
    return dx.reshape(b, l, d), grads
