"""mamba_ssm checkpoints: their config.json and tensor names, both ways.

A mamba_ssm directory (e.g. `state-spaces/mamba-130m`, or what `MambaLMHeadModel.save_pretrained` writes) holds a
config.json of `mamba_ssm.models.config_mamba.MambaConfig` fields (`d_model`, `d_intermediate`, `n_layer`,
`vocab_size`, `ssm_cfg`, `attn_layer_idx`, `attn_cfg`, `rms_norm`, `residual_in_fp32`, `fused_add_norm`,
`pad_vocab_size_multiple`, `tie_embeddings`) and a `pytorch_model.bin` (read and written by
`mambactl.interop.torch_zip`, never by torch) with `backbone.embedding.weight` (singular),
`backbone.layers.{i}.{norm,mixer.*}`, `backbone.norm_f.weight` and the tied `lm_head.weight`.

Every layer is `ssm_cfg["layer"]` (Mamba1, Mamba2 or Mamba3; one type for all) except those in `attn_layer_idx`,
which are `MHA(**attn_cfg)`. Mixer tensor names are mamba_ssm's, which are mambactl's (`models/params.py`), but
for the embedding and MHA's fused projection: `mixer.in_proj` (rows q | k | v, heads contiguous in each, exactly
mambactl's layout) is mambactl's `mixer.qkv_proj`. Nothing is reshaped. Whatever mamba_ssm expresses and
mambactl's model does not compute (MLPs, LayerNorm, grouped-query or bidirectional attention, partial or
interleaved rotary, ...) is refused in one line naming the key, its value and what is supported.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from mambactl.errors import MambactlError
from mambactl.interop.torch_zip import read_torch_checkpoint, write_torch_checkpoint
from mambactl.models.config import ModelConfig
from mambactl.models.params import parameter_specs

__all__ = ["RENAMES", "export_mamba_ssm", "is_mamba_ssm_config", "mamba_ssm_config", "mamba_ssm_tensors",
           "model_from_mamba_ssm", "read_torch_checkpoint", "tensor_renames"]

# mamba_ssm spells the embedding `embedding`; HF (and mambactl) `embeddings` (HF's MambaModel load hook renames it).
RENAMES = (("backbone.embedding.", "backbone.embeddings."),)
EMBED, HEAD = "backbone.embedding.weight", "lm_head.weight"
NORM_EPS = 1e-5  # mamba_ssm's block norms, norm_f and gated norms (MixerModel's norm_epsilon, not in MambaConfig)
FILES = ("config.json", "pytorch_model.bin", "tokenizer.json")

# mamba_ssm `Mamba` / `Mamba2` / `Mamba3` arguments mambactl's config keeps, and those that only choose kernels or
# init schemes (or that Mamba3 only absorbs).
_MAMBA1_KEYS = {"d_state", "d_conv", "expand", "dt_rank", "dt_min", "dt_max", "dt_init_floor", "bias", "conv_bias"}
_MAMBA2_KEYS = {"d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "A_init_range", "dt_min",
                "dt_max", "dt_init_floor", "dt_limit", "bias", "conv_bias"}
_MAMBA3_KEYS = {"d_state", "expand", "headdim", "ngroups", "rope_fraction", "dt_min", "dt_max", "dt_init_floor",
                "A_floor", "is_outproj_norm", "is_mimo", "mimo_rank", "chunk_size"}
_INERT_KEYS = {"dt_init", "dt_scale", "conv_init", "use_fast_path", "use_mem_eff_path", "layer_idx",
               "process_group", "sequence_parallel"}
_MAMBA3_INERT = {"dropout", "layer_idx", "n_layer"}
_LAYERS = {"Mamba1": ("mamba1", _MAMBA1_KEYS, _INERT_KEYS), "Mamba2": ("mamba2", _MAMBA2_KEYS, _INERT_KEYS),
           "Mamba3": ("mamba3", _MAMBA3_KEYS, _MAMBA3_INERT)}
# Mamba-2 variants mambactl's block does not compute: key -> the value it must have.
_MAMBA2_FIXED = {"rmsnorm": True, "norm_before_gate": False, "D_has_hdim": False}
# `MHA` arguments (mamba_ssm/modules/mha.py) and their defaults; num_heads has none.
_MHA_DEFAULTS = {"num_heads": None, "num_heads_kv": None, "head_dim": None, "mlp_dim": 0, "qkv_proj_bias": True,
                 "out_proj_bias": True, "softmax_scale": None, "causal": False, "d_conv": 0, "rotary_emb_dim": 0,
                 "rotary_emb_base": 10000.0, "rotary_emb_interleaved": False}


# config ---------------------------------------------------------------------------------------------------------
def is_mamba_ssm_config(config: dict) -> bool:
    """True for a mamba_ssm MambaConfig dict (d_model / n_layer / ssm_cfg), false for a transformers config."""
    return "model_type" not in config and "d_model" in config and "n_layer" in config


def model_from_mamba_ssm(config: dict) -> tuple[dict, str, int, tuple[int, ...]]:
    """A mamba_ssm config.json -> (ModelConfig fields but vocab_size and layers, the layer type of the SSM layers,
    the embedding rows the checkpoint stores, the indices of the attention layers).

    The rows are `vocab_size` padded up to `pad_vocab_size_multiple`, as mamba_ssm's MambaLMHeadModel does.
    Features mambactl's model lacks (MLPs, LayerNorm, grouped-query attention, ...) are refused by name.
    """
    def get(key: str, default: Any, kind: type = int) -> Any:
        value = config.get(key, default)
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 1)):
            raise MambactlError(f"config.json: {key} must be {_KIND_NAMES[kind]}, got {value!r}")
        return value

    d_model, n_layer = get("d_model", None), get("n_layer", None)
    vocab, multiple = get("vocab_size", None), get("pad_vocab_size_multiple", 8)
    if config.get("d_intermediate", 0) != 0:
        _refuse("d_intermediate", config["d_intermediate"], "a gated MLP after every mixer", "0")
    if config.get("rms_norm", True) is not True:
        _refuse("rms_norm", config["rms_norm"], "LayerNorm", "true")
    for key in ("residual_in_fp32", "fused_add_norm"):  # precision / kernel choices: the math is the same
        get(key, True, bool)
    attention = get("attn_layer_idx", [], list)
    if not (all(type(i) is int and 0 <= i < n_layer for i in attention) and len(set(attention)) == len(attention)):
        raise MambactlError(f"config.json: attn_layer_idx must list distinct layer indices in [0, n_layer = "
                            f"{n_layer}), got {_json(attention)}")
    kind, mixer = _ssm_fields(get("ssm_cfg", {}, dict), d_model)
    model = {"d_model": d_model, "n_layer": n_layer, "norm_eps": NORM_EPS, "pad_vocab_size_multiple": multiple,
             "tie_embeddings": get("tie_embeddings", True, bool), kind: mixer}
    if attention:
        model["attention"] = _attention_fields(get("attn_cfg", {}, dict), d_model)
    return model, kind, _pad(vocab, multiple), tuple(sorted(attention))


def _ssm_fields(ssm_cfg: dict, d_model: int) -> tuple[str, dict]:
    """ssm_cfg -> (mambactl layer type, its config fields)."""
    ssm = dict(ssm_cfg)
    layer = ssm.pop("layer", "Mamba1")
    if layer not in _LAYERS:
        raise MambactlError(f"config.json: unsupported architecture: ssm_cfg.layer = {layer!r} "
                            "(mambactl imports Mamba1, Mamba2 and Mamba3 layers)")
    kind, known, inert = _LAYERS[layer]
    if kind == "mamba2":
        for key, value in _MAMBA2_FIXED.items():
            if ssm.pop(key, value) != value:
                raise MambactlError(f"config.json: ssm_cfg.{key} = {_json(not value)} is not supported (mambactl's "
                                    f"Mamba-2 has a gated RMSNorm, gate before norm, one D per head); supported: "
                                    f"{_json(value)}")
        d_ssm = ssm.pop("d_ssm", None)
        if d_ssm is not None and d_ssm != ssm.get("expand", 2) * d_model:
            raise MambactlError("config.json: ssm_cfg.d_ssm != expand * d_model (a gated-MLP part) is not supported")
    unknown = sorted(set(ssm) - known - inert)
    if unknown:
        raise MambactlError(f"config.json: ssm_cfg.{unknown[0]} is not a {layer} setting mambactl knows "
                            f"(supported: {', '.join(sorted(known))})")
    return kind, {k: v for k, v in ssm.items() if k in known}


def _attention_fields(attn_cfg: dict, d_model: int) -> dict:
    """attn_cfg (mamba_ssm `MHA` arguments) -> AttentionConfig fields; what MHA can do and mambactl's attention
    cannot is refused by name."""
    unknown = sorted(set(attn_cfg) - set(_MHA_DEFAULTS))
    if unknown:
        raise MambactlError(f"config.json: attn_cfg.{unknown[0]} is not an MHA setting mambactl knows "
                            f"(supported: {', '.join(_MHA_DEFAULTS)})")
    cfg = _MHA_DEFAULTS | attn_cfg
    heads = cfg["num_heads"]
    if type(heads) is not int or heads < 1:
        raise MambactlError(f"config.json: attn_cfg.num_heads must be a positive integer, got {_json(heads)}")

    def refuse(key: str, why: str, supported: str) -> None:
        _refuse(f"attn_cfg.{key}", cfg[key], why, supported)

    if d_model % heads:
        refuse("num_heads", f"it does not divide d_model = {d_model}", "a divisor of d_model")
    head_dim = d_model // heads
    if cfg["head_dim"] not in (None, head_dim):
        refuse("head_dim", "num_heads * head_dim != d_model", f"null or d_model / num_heads = {head_dim}")
    if cfg["num_heads_kv"] not in (None, heads):
        refuse("num_heads_kv", "grouped-query / multi-query attention", f"null or num_heads = {heads}")
    if cfg["mlp_dim"] != 0:
        refuse("mlp_dim", "a gated MLP inside the attention mixer", "0")
    if cfg["d_conv"] != 0:
        refuse("d_conv", "a causal conv over q, k, v", "0")
    if cfg["causal"] is not True:
        refuse("causal", "bidirectional attention, MHA's default", "true")
    if cfg["rotary_emb_dim"] not in (0, head_dim):
        refuse("rotary_emb_dim", "partial rotary", f"0 (no rotary) or head_dim = {head_dim}")
    rope = cfg["rotary_emb_dim"] == head_dim
    if rope and cfg["rotary_emb_interleaved"] is not False:
        refuse("rotary_emb_interleaved", "rotary on pairs (2i, 2i + 1)", "false (pairs (i, i + head_dim / 2))")
    scale = cfg["softmax_scale"]
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isclose(scale, head_dim ** -0.5, rel_tol=1e-6)):
        refuse("softmax_scale", "a scale other than 1 / sqrt(head_dim)",
               f"null or 1 / sqrt(head_dim) = {head_dim ** -0.5:.7g}")
    if type(cfg["qkv_proj_bias"]) is not bool or cfg["qkv_proj_bias"] != cfg["out_proj_bias"]:
        raise MambactlError(f"config.json: attn_cfg.qkv_proj_bias = {_json(cfg['qkv_proj_bias'])} with "
                            f"out_proj_bias = {_json(cfg['out_proj_bias'])} is not supported; supported: both true "
                            "or both false")
    base = cfg["rotary_emb_base"]
    return {"n_heads": heads, "rope": rope, "rope_base": float(base) if type(base) is int else base,
            "bias": cfg["qkv_proj_bias"]}


def _refuse(key: str, value: Any, why: str, supported: str) -> None:
    raise MambactlError(f"config.json: {key} = {_json(value)} is not supported ({why}); supported: {supported}")


def _json(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


_KIND_NAMES = {int: "a positive integer", bool: "true or false", dict: "an object", list: "a list"}


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def tensor_renames(attention: Iterable[int]) -> tuple[tuple[str, str], ...]:
    """(mamba_ssm prefix, mambactl prefix) pairs: the embedding, and MHA's in_proj (mambactl's qkv_proj) in each
    attention layer."""
    return RENAMES + tuple((f"backbone.layers.{i}.mixer.in_proj.", f"backbone.layers.{i}.mixer.qkv_proj.")
                           for i in attention)


# export ---------------------------------------------------------------------------------------------------------
def mamba_ssm_config(cfg: ModelConfig) -> dict:
    """config.json (MambaConfig fields) of the mamba_ssm model equal to `cfg`; refuses what mamba_ssm cannot hold."""
    if cfg.norm_eps != NORM_EPS:
        raise MambactlError(f"mamba_ssm has no norm_eps setting (its norms use {NORM_EPS:g}); this model has "
                            f"norm_eps = {cfg.norm_eps:g}")
    kinds = sorted(set(cfg.layers) - {"attention"})
    unknown = sorted(set(kinds) - {kind for kind, _, _ in _LAYERS.values()})
    if unknown:
        raise MambactlError(f"mamba_ssm has no {unknown[0]} layers (it has Mamba1, Mamba2, Mamba3 and MHA)")
    if len(kinds) > 1:
        raise MambactlError(f"mamba_ssm has one ssm_cfg for every SSM layer; this model mixes {', '.join(kinds)}")
    ssm_cfg = _ssm_cfg(cfg, kinds[0]) if kinds else {}
    attention = [i for i, kind in enumerate(cfg.layers) if kind == "attention"]
    attn_cfg = {}
    if attention:
        a, head_dim = cfg.attention, cfg.attention_head_dim
        attn_cfg = {"num_heads": a.n_heads, "num_heads_kv": a.n_heads, "head_dim": head_dim, "causal": True,
                    "qkv_proj_bias": a.bias, "out_proj_bias": a.bias, "rotary_emb_dim": head_dim if a.rope else 0,
                    "rotary_emb_base": a.rope_base, "rotary_emb_interleaved": False, "d_conv": 0, "mlp_dim": 0}
    return {"d_model": cfg.d_model, "d_intermediate": 0, "n_layer": cfg.n_layer, "vocab_size": cfg.vocab_size,
            "ssm_cfg": ssm_cfg, "attn_layer_idx": attention, "attn_cfg": attn_cfg, "rms_norm": True,
            "residual_in_fp32": True, "fused_add_norm": True,
            "pad_vocab_size_multiple": cfg.pad_vocab_size_multiple, "tie_embeddings": True}


def _ssm_cfg(cfg: ModelConfig, kind: str) -> dict:
    layer = next(name for name, (k, _, _) in _LAYERS.items() if k == kind)
    fields = asdict(getattr(cfg, kind))
    if kind == "mamba2":
        fields.pop("dt_limit")
        if cfg.mamba2.has_dt_limit:  # the default (0, inf) is left out: JSON has no inf
            fields["dt_limit"] = list(cfg.mamba2.dt_limit_inf)
    return {"layer": layer, **fields}


def mamba_ssm_tensors(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray],
                                                                                    dict[str, str]]:
    """mambactl weights -> ({mamba_ssm name: array} in parameter order, then the tied lm_head.weight; ties)."""
    pairs = tensor_renames(i for i, kind in enumerate(cfg.layers) if kind == "attention")

    def theirs(name: str) -> str:
        return next((t + name[len(o):] for t, o in pairs if name.startswith(o)), name)

    tensors = {theirs(s.name): weights[s.name] for s in parameter_specs(cfg)}
    tensors[HEAD] = tensors[EMBED]
    return tensors, {HEAD: EMBED}


def export_mamba_ssm(package, out_dir: str | Path) -> list[Path]:
    """Write `package` as a new mamba_ssm directory (config.json, pytorch_model.bin, tokenizer.json); return the
    files. Built in a temporary sibling directory and renamed into place: `out_dir` appears complete or not at all.
    An existing `out_dir` must be an empty directory."""
    out_dir = Path(out_dir)
    config = mamba_ssm_config(package.config)  # refuses what mamba_ssm cannot hold, first
    tensors, ties = mamba_ssm_tensors(package.config, package.weights)
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        raise MambactlError(f"{out_dir}: already exists; mamba_ssm export writes a new directory")
    if not out_dir.parent.is_dir():
        raise MambactlError(f"{out_dir}: directory {out_dir.parent} does not exist")
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
        write_torch_checkpoint(tmp / "pytorch_model.bin", tensors, ties)
        (tmp / "tokenizer.json").write_text(package.tokenizer.to_str(), encoding="utf-8")
        for name in FILES:
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, out_dir)  # replaces an empty directory; fails (leaving it) if one appeared meanwhile
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise MambactlError(f"{out_dir}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out_dir / name for name in FILES]
