"""Parameter description of a model: names (mamba_ssm / HF transformers), shapes, init and weight decay.

One table drives initialisation, the optimizer's no-decay set, checkpoint validation and import/export,
so a name is spelled in exactly one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mambactl.models.config import ModelConfig


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    init: str  # how `init_parameters` fills it; see there
    no_decay: bool  # AdamW leaves it undecayed (mamba_ssm's `_no_weight_decay` + norms, biases)


def parameter_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """All parameters in a fixed order: embedding, layers 0..n-1, norm_f. The head is tied to the embedding."""
    d, V = cfg.d_model, cfg.padded_vocab_size
    specs = [ParamSpec("backbone.embeddings.weight", (V, d), "embedding", True)]
    for i, kind in enumerate(cfg.layers):
        p = f"backbone.layers.{i}."
        specs.append(ParamSpec(p + "norm.weight", (d,), "ones", True))
        if kind == "mamba1":
            specs += _mamba1_specs(cfg, p + "mixer.")
        elif kind == "mamba2":
            specs += _mamba2_specs(cfg, p + "mixer.")
        elif kind == "mamba3":
            specs += _mamba3_specs(cfg, p + "mixer.")
        elif kind == "attention":
            specs += _attention_specs(cfg, p + "mixer.")
    specs.append(ParamSpec("backbone.norm_f.weight", (d,), "ones", True))
    return specs


def _mamba1_specs(cfg: ModelConfig, p: str) -> list[ParamSpec]:
    m, d, di, R = cfg.mamba1, cfg.d_model, cfg.d_inner, cfg.dt_rank
    specs = [ParamSpec(p + "in_proj.weight", (2 * di, d), "linear", False)]
    if m.bias:
        specs.append(ParamSpec(p + "in_proj.bias", (2 * di,), "zeros", True))
    specs.append(ParamSpec(p + "conv1d.weight", (di, 1, m.d_conv), "conv", False))
    if m.conv_bias:
        specs.append(ParamSpec(p + "conv1d.bias", (di,), "conv_bias", True))
    specs += [
        ParamSpec(p + "x_proj.weight", (R + 2 * m.d_state, di), "linear", False),
        ParamSpec(p + "dt_proj.weight", (di, R), "dt_proj", False),
        ParamSpec(p + "dt_proj.bias", (di,), "dt_bias", True),
        ParamSpec(p + "A_log", (di, m.d_state), "A_log", True),
        ParamSpec(p + "D", (di,), "ones", True),
        ParamSpec(p + "out_proj.weight", (d, di), "out_proj", False),
    ]
    if m.bias:
        specs.append(ParamSpec(p + "out_proj.bias", (d,), "zeros", True))
    return specs


def _mamba2_specs(cfg: ModelConfig, p: str) -> list[ParamSpec]:
    """mamba_ssm `Mamba2` (and HF `Mamba2Mixer`) tensors, in mamba_ssm's registration order.

    in_proj rows are [z, x, B, C, dt] (d_inner, d_inner, G·N, G·N, H); the conv runs over [x, B, C].
    """
    m, d, di, H = cfg.mamba2, cfg.d_model, cfg.mamba2_d_inner, cfg.mamba2_nheads
    specs = [ParamSpec(p + "in_proj.weight", (cfg.mamba2_in_proj_dim, d), "linear", False)]
    if m.bias:
        specs.append(ParamSpec(p + "in_proj.bias", (cfg.mamba2_in_proj_dim,), "zeros", True))
    specs.append(ParamSpec(p + "conv1d.weight", (cfg.mamba2_conv_dim, 1, m.d_conv), "conv", False))
    if m.conv_bias:
        specs.append(ParamSpec(p + "conv1d.bias", (cfg.mamba2_conv_dim,), "mamba2_conv_bias", True))
    specs += [
        ParamSpec(p + "dt_bias", (H,), "mamba2_dt_bias", True),
        ParamSpec(p + "A_log", (H,), "mamba2_A_log", True),
        ParamSpec(p + "D", (H,), "ones", True),
        ParamSpec(p + "norm.weight", (di,), "ones", True),
        ParamSpec(p + "out_proj.weight", (d, di), "out_proj", False),
    ]
    if m.bias:
        specs.append(ParamSpec(p + "out_proj.bias", (d,), "zeros", True))
    return specs


def _mamba3_specs(cfg: ModelConfig, p: str) -> list[ParamSpec]:
    """mamba_ssm `Mamba3` tensors, in its registration order (no conv, no Linear biases).

    in_proj rows are [z, x, B, C, dd_dt, dd_A, trap, angle] (d_inner, d_inner, R·G·N, R·G·N, H, H, H, S), B and C
    laid out (rank, group, state). mimo_* exist only with is_mimo, norm.weight only with is_outproj_norm. No decay
    for dt_bias and D (mamba_ssm's `_no_weight_decay`), the norms and the B/C biases; mimo_* decay like weights.
    """
    m, d, di, H, R = cfg.mamba3, cfg.d_model, cfg.mamba3_d_inner, cfg.mamba3_nheads, cfg.mamba3_rank
    N, P = m.d_state, m.headdim
    specs = [
        ParamSpec(p + "in_proj.weight", (cfg.mamba3_in_proj_dim, d), "linear", False),
        ParamSpec(p + "dt_bias", (H,), "mamba3_dt_bias", True),
        ParamSpec(p + "B_bias", (H, R, N), "ones", True),
        ParamSpec(p + "C_bias", (H, R, N), "ones", True),
        ParamSpec(p + "B_norm.weight", (N,), "ones", True),
        ParamSpec(p + "C_norm.weight", (N,), "ones", True),
    ]
    if m.is_mimo:
        specs += [
            ParamSpec(p + "mimo_x", (H, R, P), "inv_rank", False),
            ParamSpec(p + "mimo_z", (H, R, P), "ones", False),
            ParamSpec(p + "mimo_o", (H, R, P), "inv_rank", False),
        ]
    specs.append(ParamSpec(p + "D", (H,), "ones", True))
    if m.is_outproj_norm:
        specs.append(ParamSpec(p + "norm.weight", (di,), "ones", True))
    specs.append(ParamSpec(p + "out_proj.weight", (d, di), "out_proj", False))
    return specs


def _attention_specs(cfg: ModelConfig, p: str) -> list[ParamSpec]:
    """Fused qkv_proj (output columns q | k | v, heads contiguous within each) and out_proj."""
    d = cfg.d_model
    specs = [ParamSpec(p + "qkv_proj.weight", (3 * d, d), "linear", False)]
    if cfg.attention.bias:
        specs.append(ParamSpec(p + "qkv_proj.bias", (3 * d,), "zeros", True))
    specs.append(ParamSpec(p + "out_proj.weight", (d, d), "out_proj", False))
    if cfg.attention.bias:
        specs.append(ParamSpec(p + "out_proj.bias", (d,), "zeros", True))
    return specs


def _dt_bias(rng, shape, dt_min: float, dt_max: float, floor: float) -> np.ndarray:
    """Inverse softplus of a log-uniform Δ in [dt_min, dt_max], floored (mamba_ssm, both Mamba-1 and -2)."""
    dt = np.exp(rng.uniform(0, 1, shape) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = np.maximum(dt, floor)
    return dt + np.log(-np.expm1(-dt))  # inverse softplus


def count_parameters(cfg: ModelConfig) -> int:
    return sum(int(np.prod(s.shape)) for s in parameter_specs(cfg))


def init_parameters(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """mamba_ssm's initialisation (mamba_simple.Mamba / mamba2.Mamba2 / mamba3.Mamba3 __init__ +
    mixer_seq_simple._init_weights), float32."""
    rng = np.random.default_rng(seed)
    m, m2 = cfg.mamba1, cfg.mamba2
    out: dict[str, np.ndarray] = {}
    for s in parameter_specs(cfg):
        fan_in = int(np.prod(s.shape[1:])) if len(s.shape) > 1 else 1
        # PyTorch's default Linear/Conv init: kaiming_uniform(a=sqrt(5)) -> U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound = 1.0 / math.sqrt(fan_in)
        if s.init == "embedding":
            w = rng.normal(0.0, 0.02, s.shape)
        elif s.init == "ones":
            w = np.ones(s.shape)
        elif s.init == "zeros":
            w = np.zeros(s.shape)
        elif s.init in ("linear", "conv"):
            w = rng.uniform(-bound, bound, s.shape)
        elif s.init == "conv_bias":
            w = rng.uniform(-1.0 / math.sqrt(m.d_conv), 1.0 / math.sqrt(m.d_conv), s.shape)
        elif s.init == "out_proj":
            w = rng.uniform(-bound, bound, s.shape) / math.sqrt(cfg.n_layer)
        elif s.init == "dt_proj":
            std = cfg.dt_rank ** -0.5
            w = rng.uniform(-std, std, s.shape)
        elif s.init == "dt_bias":
            w = _dt_bias(rng, s.shape, m.dt_min, m.dt_max, m.dt_init_floor)
        elif s.init == "A_log":
            w = np.log(np.broadcast_to(np.arange(1, s.shape[1] + 1, dtype=np.float64), s.shape))
        elif s.init == "mamba2_conv_bias":
            w = rng.uniform(-1.0 / math.sqrt(m2.d_conv), 1.0 / math.sqrt(m2.d_conv), s.shape)
        elif s.init == "mamba2_dt_bias":
            w = _dt_bias(rng, s.shape, m2.dt_min, m2.dt_max, m2.dt_init_floor)
        elif s.init == "mamba2_A_log":  # A = -exp(A_log) ~ -U(A_init_range) per head
            w = np.log(rng.uniform(m2.A_init_range[0], m2.A_init_range[1], s.shape))
        elif s.init == "mamba3_dt_bias":
            m3 = cfg.mamba3
            w = _dt_bias(rng, s.shape, m3.dt_min, m3.dt_max, m3.dt_init_floor)
        elif s.init == "inv_rank":  # mimo_x, mimo_o [H, R, P] = 1 / R
            w = np.full(s.shape, 1.0 / s.shape[1])
        else:
            raise AssertionError(f"unknown init {s.init!r} for {s.name}")
        out[s.name] = np.ascontiguousarray(w, dtype=np.float32)
    return out
