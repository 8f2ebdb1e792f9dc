"""Parity with the official Mamba-3 equations: a float64 PyTorch port of mamba_ssm's `Mamba3.forward` (in_proj
split, heavy-tail A, B/C RMSNorm, out-norm) around ports of its pure-PyTorch recurrences
`mamba3_siso_step_ref` (tests/ops/triton/test_mamba3_siso.py) and `mamba3_MIMO_step_ref`
(tests/ops/tilelang/test_mamba3_mimo.py), run on random weights and inputs against the float64 reference:
outputs (< 1e-10) and, by torch autograd through the port, every parameter gradient and dx (< 1e-8).

The port is test-only code, written from the official equations. One thing the MIMO step ref does not do as the
module: it rotates state pairs (2i, 2i+1), while `Mamba3` with is_mimo runs the TileLang kernel (and
`apply_rotary_qk_inference_fwd(rotate_pairwise=False)` when decoding), which pairs i with i + N/2. The port
takes the pairing as an argument: the module's pairing is compared directly, the literal ref's pairing after
relabelling the state dims of the weights (the two are the same model up to that permutation).
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from mambactl.models.config import Mamba3Config, ModelConfig  # noqa: E402
from mambactl.models.params import init_parameters  # noqa: E402
from mambactl.reference.mamba3 import mamba3_block, mamba3_block_backward  # noqa: E402


# --- the port (float64 torch) ----------------------------------------------------------------------------------------


def _rotary(t, cos, sin, pairwise):
    """Rotate the first S pairs of t [..., N] by angles [..., S] (cos 1 / sin 0 beyond): pairs (2i, 2i+1) as
    the step refs, or (i, i + N/2) as `apply_rotary_qk_inference_reference(rotate_pairwise=False)`."""
    half = t.shape[-1] // 2
    if cos.shape[-1] < half:
        cos = F.pad(cos, (0, half - cos.shape[-1]), value=1.0)
        sin = F.pad(sin, (0, half - sin.shape[-1]), value=0.0)
    if pairwise:
        t0, t1 = t.reshape(*t.shape[:-1], half, 2).unbind(-1)
        return torch.stack([t0 * cos - t1 * sin, t0 * sin + t1 * cos], dim=-1).reshape(t.shape)
    t0, t1 = t[..., :half], t[..., half:]
    return torch.cat([t0 * cos - t1 * sin, t0 * sin + t1 * cos], dim=-1)


def siso_step_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z):
    """mamba3_siso_step_ref from zero states: Q, K (b, l, g, n); V, Z (b, l, h, p); ADT, DT, Trap (b, h, l)
    (Trap before the sigmoid); Q_bias, K_bias (h, n); Angles (b, l, h, s) -> (b, l, h, p)."""
    b, l, h, p = V.shape
    Angles = torch.tanh(Angles) * math.pi
    Q = Q.repeat_interleave(h // Q.shape[2], dim=2)
    K = K.repeat_interleave(h // K.shape[2], dim=2)
    angle = torch.zeros(b, h, Angles.shape[-1], dtype=V.dtype)
    state = torch.zeros(b, h, p, Q.shape[-1], dtype=V.dtype)
    k_state, v_state = torch.zeros(b, h, Q.shape[-1], dtype=V.dtype), torch.zeros(b, h, p, dtype=V.dtype)
    outs = []
    for t in range(l):
        q, k, v = Q[:, t] + Q_bias, K[:, t] + K_bias, V[:, t]
        dt = DT[:, :, t]
        angle = angle + Angles[:, t] * dt[..., None]
        angle = angle - 2 * math.pi * torch.floor(angle / (2 * math.pi))
        q_rot = _rotary(q, torch.cos(angle), torch.sin(angle), True)
        k_rot = _rotary(k, torch.cos(angle), torch.sin(angle), True)
        trap = torch.sigmoid(Trap[:, :, t])
        alpha = torch.exp(ADT[:, :, t])
        beta, gamma = (1 - trap) * dt * alpha, trap * dt
        state = (alpha[..., None, None] * state + beta[..., None, None] * (v_state[..., None] * k_state[..., None, :])
                 + gamma[..., None, None] * (v[..., None] * k_rot[..., None, :]))
        out = torch.einsum("bhdD,bhD->bhd", state, q_rot) + D[None, :, None] * v
        if Z is not None:
            out = out * Z[:, t] * torch.sigmoid(Z[:, t])
        outs.append(out)
        k_state, v_state = k_rot, v
    return torch.stack(outs, dim=1)


def mimo_step_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, MIMO_V, MIMO_O, D, Z, MIMO_Z, pairwise,
                  norm_weight=None, eps=1e-5):
    """mamba3_MIMO_step_ref from zero states: Q, K (b, l, r, g, n); V, Z (b, l, h, p); ADT, DT, Trap (b, h, l);
    Q_bias, K_bias (h, r, n); MIMO_* (h, r, p); Angles (b, l, h, s). `norm_weight` (h, p) is its fused_norm."""
    b, l, r, g, n = Q.shape
    h, p = V.shape[2:]
    Q = Q.repeat_interleave(h // g, dim=3)
    K = K.repeat_interleave(h // g, dim=3)
    angle = torch.zeros(b, h, Angles.shape[-1], dtype=V.dtype)
    state = torch.zeros(b, h, p, n, dtype=V.dtype)
    k_state, v_state = torch.zeros(b, h, r, n, dtype=V.dtype), torch.zeros(b, h, r, p, dtype=V.dtype)
    v_proj = torch.einsum("bthd,hrd->btrhd", V, MIMO_V)
    z_proj = torch.einsum("bthd,hrd->btrhd", Z, MIMO_Z)
    outs = []
    for t in range(l):
        q = (Q[:, t] + Q_bias.permute(1, 0, 2)).permute(0, 2, 1, 3)  # (b, h, r, n)
        k = (K[:, t] + K_bias.permute(1, 0, 2)).permute(0, 2, 1, 3)
        v, z = v_proj[:, t].permute(0, 2, 1, 3), z_proj[:, t].permute(0, 2, 1, 3)
        dt = DT[:, :, t]
        angle = angle + torch.tanh(Angles[:, t]) * dt[..., None] * math.pi
        cos, sin = torch.cos(angle)[:, :, None], torch.sin(angle)[:, :, None]
        q_rot, k_rot = _rotary(q, cos, sin, pairwise), _rotary(k, cos, sin, pairwise)
        trap = torch.sigmoid(Trap[:, :, t])
        alpha = torch.exp(ADT[:, :, t])
        beta, gamma = (1 - trap) * dt * alpha, trap * dt
        state = (alpha[..., None, None] * state
                 + beta[..., None, None] * torch.einsum("bhrd,bhrp->bhpd", k_state, v_state)
                 + gamma[..., None, None] * torch.einsum("bhrd,bhrp->bhpd", k_rot, v))
        out = torch.einsum("bhpd,bhrd->bhrp", state, q_rot) + D[None, :, None, None] * v
        if norm_weight is not None:
            out = out * torch.rsqrt(out.square().mean(dim=-1, keepdim=True) + eps) * norm_weight[None, :, None, :]
        out = out * z * torch.sigmoid(z)
        outs.append(torch.einsum("bhrp,hrp->bhp", out, MIMO_O))
        k_state, v_state = k_rot, v
    return torch.stack(outs, dim=1)


def rms_norm(x, w, eps=1e-5):
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps) * w


def port_block(p, u, cfg, pairwise=None):
    """mamba_ssm `Mamba3.forward` on u (b, l, d_model), p: name -> float64 tensor."""
    m = cfg.mamba3
    b, l, _ = u.shape
    di, H, P, G, N = cfg.mamba3_d_inner, cfg.mamba3_nheads, m.headdim, m.ngroups, m.d_state
    R, S = cfg.mamba3_rank, cfg.mamba3_num_rope_angles
    z, x, B, C, dd_dt, dd_A, trap, angles = torch.split(
        u @ p["in_proj.weight"].T, [di, di, N * G * R, N * G * R, H, H, H, S], dim=-1)
    z, x = z.reshape(b, l, H, P), x.reshape(b, l, H, P)
    B, C = B.reshape(b, l, R, G, N), C.reshape(b, l, R, G, N)  # "b l (r g n) -> b l r g n"
    heavy = torch.where(dd_A >= 0, 1 + dd_A, 1 / (1 - torch.clamp(dd_A, max=0)))
    A = torch.clamp(-heavy, max=-m.A_floor)
    DT = F.softplus(dd_dt + p["dt_bias"])
    ADT, DT, trap = (A * DT).transpose(1, 2), DT.transpose(1, 2), trap.transpose(1, 2)
    angles = angles.unsqueeze(-2).expand(-1, -1, H, -1)
    B, C = rms_norm(B, p["B_norm.weight"]), rms_norm(C, p["C_norm.weight"])
    if m.is_mimo:
        w = p["norm.weight"].reshape(H, P) if m.is_outproj_norm else None
        y = mimo_step_ref(C, B, x, ADT, DT, trap, p["C_bias"], p["B_bias"], angles, p["mimo_x"], p["mimo_o"], p["D"],
                          z, p["mimo_z"], pairwise=False if pairwise is None else pairwise, norm_weight=w)
    else:
        y = siso_step_ref(C[:, :, 0], B[:, :, 0], x, ADT, DT, trap, p["C_bias"][:, 0], p["B_bias"][:, 0], angles,
                          p["D"], None if m.is_outproj_norm else z)
        if m.is_outproj_norm:  # RMSNormGated(group_size=headdim, norm_before_gate=True)
            y = rms_norm(y, p["norm.weight"].reshape(H, P)) * F.silu(z)
    return y.reshape(b, l, di) @ p["out_proj.weight"].T


# --- the comparison --------------------------------------------------------------------------------------------------


def config(**mamba3):
    """d_model 8 -> d_inner 16 -> 4 heads of 4 channels, d_state 8."""
    m = dict(d_state=8, headdim=4, chunk_size=3, mimo_rank=2) | mamba3
    return ModelConfig(vocab_size=11, d_model=8, n_layer=1, layers=["mamba3"], mamba3=Mamba3Config(**m))


def random_params(cfg, seed):
    """The mixer's tensors at mamba_ssm's init plus noise (Δ ≈ 0.7 so the state carries signal)."""
    rng = np.random.default_rng(seed)
    prefix = "backbone.layers.0.mixer."
    params = {k[len(prefix):]: v.astype(np.float64) for k, v in init_parameters(cfg, seed).items()
              if k.startswith(prefix)}
    for k, v in params.items():
        v += rng.normal(0.0, 0.5 if k == "in_proj.weight" else 0.3, v.shape)
    params["dt_bias"] = rng.normal(0.0, 1.0, params["dt_bias"].shape)
    return params


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def compare(cfg, params, port_params=None, pairwise=None, L=7, seed=0):
    """-> (output error, {name: gradient error}) of our block vs the port (fed port_params, default params)."""
    rng = np.random.default_rng(seed + 100)
    x = rng.normal(size=(2, L, cfg.d_model))
    dy = rng.normal(size=x.shape)
    y, saved = mamba3_block(params, x, cfg)
    dx, grads = mamba3_block_backward(params, saved, dy, cfg)

    tp = {k: torch.tensor(v, requires_grad=True) for k, v in (port_params or params).items()}
    tx = torch.tensor(x, requires_grad=True)
    ty = port_block(tp, tx, cfg, pairwise)
    (ty * torch.from_numpy(dy)).sum().backward()
    errors = {k: rel(grads[k], tp[k].grad.numpy()) for k in grads} | {"x": rel(dx, tx.grad.numpy())}
    return rel(y, ty.detach().numpy()), errors


CASES = [
    dict(),
    dict(rope_fraction=1.0, ngroups=2),
    dict(is_outproj_norm=True, chunk_size=2),
    dict(is_mimo=True),
    dict(is_mimo=True, rope_fraction=1.0, ngroups=2, mimo_rank=3),
    dict(is_mimo=True, is_outproj_norm=True, chunk_size=4),
]


@pytest.mark.parametrize("case", CASES, ids=["siso", "siso_rope1_g2", "siso_outnorm", "mimo", "mimo_rope1_g2_r3",
                                             "mimo_outnorm"])
def test_block_matches_the_official_equations(case):
    cfg = config(**case)
    out_err, grad_errs = compare(cfg, random_params(cfg, 1))
    assert out_err < 1e-10, out_err
    assert max(grad_errs.values()) < 1e-8, grad_errs


def test_heavy_tail_floor_bites():
    """A_floor 0.5: the clamp holds A at −0.5 for some tokens, in both the value and the gradient."""
    cfg = config(A_floor=0.5)
    out_err, grad_errs = compare(cfg, random_params(cfg, 2))
    assert out_err < 1e-10 and max(grad_errs.values()) < 1e-8, (out_err, grad_errs)


@pytest.mark.parametrize("rope_fraction", [0.5, 1.0])
def test_mimo_pairwise_ref_is_the_same_model_relabelled(rope_fraction):
    """The literal mamba3_MIMO_step_ref rotates (2i, 2i+1); with B/C weights whose state dims are relabelled
    (2i -> i, 2i+1 -> i + N/2 for rotated pairs, the rest in order) it computes exactly our MIMO block."""
    cfg = config(is_mimo=True, rope_fraction=rope_fraction)
    N, S, R, G = cfg.mamba3.d_state, cfg.mamba3_num_rope_angles, cfg.mamba3_rank, cfg.mamba3.ngroups
    ours = np.concatenate([np.stack([np.arange(S), np.arange(S) + N // 2], axis=1).ravel(),
                           [n for n in range(N) if not (n < S or N // 2 <= n < N // 2 + S)]]).astype(int)
    params = random_params(cfg, 3)
    lit = dict(params)
    for k in ("B_norm.weight", "C_norm.weight", "B_bias", "C_bias"):
        lit[k] = params[k][..., ours]
    w = params["in_proj.weight"]
    di = cfg.mamba3_d_inner
    rows = np.arange(w.shape[0])
    for start in (2 * di, 2 * di + R * G * N):  # the B rows, then the C rows, laid out (r g n)
        block = rows[start:start + R * G * N].reshape(R * G, N)
        rows[start:start + R * G * N] = block[:, ours].ravel()
    lit["in_proj.weight"] = w[rows]
    out_err, _ = compare(cfg, params, port_params=lit, pairwise=True)
    assert out_err < 1e-10, out_err
