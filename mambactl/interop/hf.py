"""transformers-style model directories: import one into a package, export a package as one.

Import (`import_checkpoint`) reads a directory holding config.json, the weights (model.safetensors,
pytorch_model.bin, or either sharded with its `.index.json`) and a tokenizer, for `MambaForCausalLM`,
`Mamba2ForCausalLM` or a mamba_ssm release (`mambactl.interop.mamba_ssm`), and writes an `.evermind` package.
Tensor names are HF's, which are mambactl's (`parameter_specs`); nothing is reshaped.

Vocab: a checkpoint stores the embedding padded to `rows` (HF config `vocab_size`; mamba_ssm pads `vocab_size` to
`pad_vocab_size_multiple`), while a package's `vocab_size` is the tokenizer's size and `padded_vocab_size` must be
the stored rows. So vocab_size = tokenizer size and pad_vocab_size_multiple = the first of (the declared multiple,
8, 16, ..., rows) that pads it to exactly `rows`.

Export (`export_hf`) writes config.json, model.safetensors (float32; the tied lm_head is left out, as
`save_pretrained` does), tokenizer.json, tokenizer_config.json and special_tokens_map.json, loadable by
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
from tokenizers import Tokenizer

from mambactl.errors import MambactlError
from mambactl.interop.mamba_ssm import is_mamba_ssm_config, model_from_mamba_ssm, read_torch_checkpoint, tensor_renames
from mambactl.models.config import ModelConfig
from mambactl.models.params import parameter_specs
from mambactl.package.checkpoint import atomic_write, config_from_dict, first_line
from mambactl.package.evermind import Package, write_package
from mambactl.package.tokenizer import load_tokenizer, tokenizer_summary, vocab_size

EMBED, HEAD = "backbone.embeddings.weight", "lm_head.weight"
ARCHITECTURES = {"mamba1": ("MambaForCausalLM", "mamba"), "mamba2": ("Mamba2ForCausalLM", "mamba2")}
_SAFETENSORS_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "<u2"}
_PAD_MULTIPLES = (8, 16, 32, 64, 128, 256)


# reading weights ------------------------------------------------------------------------------------------------
def read_tensors(directory: Path) -> dict[str, np.ndarray]:
    """All tensors of a model directory as float32 arrays: model.safetensors, pytorch_model.bin, or the shards
    an `.index.json` names. A .bin file is read by the code-free reader of `mamba_ssm.read_torch_checkpoint`."""
    for stem, reader in (("model.safetensors", _read_safetensors), ("pytorch_model.bin", read_torch_checkpoint)):
        if (directory / stem).is_file():
            return reader(directory / stem)
        index = directory / f"{stem}.index.json"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise MambactlError(f"{index}: weight_map must be an object {{tensor: file}}")
            tensors: dict[str, np.ndarray] = {}
            for shard in sorted(set(weight_map.values())):
                if Path(shard).name != shard:
                    raise MambactlError(f"{index}: shard {shard!r} is not a file name in {directory}")
                tensors.update(reader(directory / shard))
            return tensors
    raise MambactlError(f"{directory}: no model.safetensors or pytorch_model.bin (nor a sharded index)")


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file -> {name: float32 array}; F32, F16, BF16 and F64 tensors, bounds-checked."""
    if not path.is_file():
        raise MambactlError(f"{path}: no such file")
    with open(path, "rb") as f:
        size = path.stat().st_size
        if size < 8:
            raise MambactlError(f"{path}: too short for a safetensors file")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        (n,) = struct.unpack_from("<Q", buf, 0)
        if n > size - 8:
            raise MambactlError(f"{path}: safetensors header length {n} runs past the end of the file")
        try:
            header = json.loads(buf[8:8 + n].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise MambactlError(f"{path}: safetensors header is not JSON") from None
        if not isinstance(header, dict):
            raise MambactlError(f"{path}: safetensors header is not an object")
        out = {}
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = _safetensors_tensor(path, buf, 8 + n, name, info)
        return out
    finally:
        buf.close()


def _safetensors_tensor(path: Path, buf: mmap.mmap, start: int, name: str, info: Any) -> np.ndarray:
    ok = (isinstance(info, dict) and isinstance(info.get("shape"), list)
          and all(type(d) is int and d >= 0 for d in info["shape"])
          and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
          and all(type(o) is int and o >= 0 for o in info["data_offsets"]))
    if not ok:
        raise MambactlError(f"{path}: tensor {name} needs dtype, shape and data_offsets")
    if info.get("dtype") not in _SAFETENSORS_DTYPES:
        raise MambactlError(f"{path}: tensor {name} is {info.get('dtype')}; mambactl reads F32, F16, BF16 and F64")
    dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
    begin, end = info["data_offsets"]
    count = math.prod(info["shape"])
    if end - begin != count * dtype.itemsize or start + end > len(buf):
        raise MambactlError(f"{path}: tensor {name} has bad data_offsets for shape {info['shape']}")
    raw = np.frombuffer(buf, dtype=dtype, count=count, offset=start + begin)
    if info["dtype"] == "BF16":  # bfloat16 is the top half of a float32
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])
    return raw.astype(np.float32).reshape(info["shape"])


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise MambactlError(f"{path}: no such file")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise MambactlError(f"{path}: not JSON ({first_line(exc)})") from None
    if not isinstance(data, dict):
        raise MambactlError(f"{path}: expected a JSON object")
    return data


# config.json -> ModelConfig -------------------------------------------------------------------------------------
def model_from_hf(config: dict) -> tuple[dict, str, int]:
    """An HF MambaConfig / Mamba2Config dict -> (ModelConfig fields but vocab_size and layers, the layer type,
    the embedding rows the checkpoint stores). Missing keys take transformers' class defaults."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    kind = next((k for k, (arch, mt) in ARCHITECTURES.items() if model_type == mt), None)
    arch = ARCHITECTURES[kind][0] if kind else None
    if kind is None or not isinstance(architectures, list) or (architectures and arch not in architectures):
        named = ", ".join(map(str, architectures)) if isinstance(architectures, list) and architectures else None
        raise MambactlError(f"config.json: unsupported architecture {named or model_type!r}; mambactl imports "
                            "MambaForCausalLM, Mamba2ForCausalLM and mamba_ssm checkpoints")
    get = _getter(config)
    if get("hidden_act", "silu", str) != "silu":
        raise MambactlError(f"config.json: hidden_act {config['hidden_act']!r} is not supported (mambactl uses silu)")
    d_model, expand = get("hidden_size", 768 if kind == "mamba1" else 4096), get("expand", 2)
    model: dict = {
        "d_model": d_model,
        "n_layer": get("num_hidden_layers", 32 if kind == "mamba1" else 64),
        "norm_eps": get("layer_norm_epsilon", 1e-5, float),
        "tie_embeddings": get("tie_word_embeddings", kind == "mamba1", bool),
    }
    if "pad_vocab_size_multiple" in config:
        model["pad_vocab_size_multiple"] = get("pad_vocab_size_multiple", 8)
    mixer = {
        "d_conv": get("conv_kernel", 4),
        "expand": expand,
        "bias": get("use_bias", False, bool),
        "conv_bias": get("use_conv_bias", True, bool),
        "dt_min": get("time_step_min", 1e-3, float),
        "dt_max": get("time_step_max", 0.1, float),
        "dt_init_floor": get("time_step_floor", 1e-4, float),
    }
    if kind == "mamba1":
        rank = config.get("time_step_rank", "auto")
        mixer |= {"d_state": get("state_size", 16),
                  "dt_rank": "auto" if rank == "auto" else get("time_step_rank", None)}
        if "intermediate_size" in config and get("intermediate_size", None) != expand * d_model:
            raise MambactlError(f"config.json: intermediate_size {config['intermediate_size']} != expand * "
                                f"hidden_size ({expand * d_model})")
    else:
        for key, value in (("rms_norm", True), ("norm_before_gate", False)):
            if config.get(key, value) != value:
                raise MambactlError(f"config.json: {key} = {config[key]!r} is not supported (mambactl's Mamba-2 has "
                                    "a gated RMSNorm with the gate applied before the norm)")
        mixer |= {"d_state": get("state_size", 128), "headdim": get("head_dim", 64), "ngroups": get("n_groups", 8),
                  "chunk_size": get("chunk_size", 256), "dt_limit": _dt_limit(config.get("time_step_limit"))}
        heads = get("num_heads", 128)
        if heads * mixer["headdim"] != expand * d_model:
            raise MambactlError(f"config.json: num_heads * head_dim = {heads * mixer['headdim']} != expand * "
                                f"hidden_size = {expand * d_model}")
    model[kind] = mixer
    return model, kind, get("vocab_size", 50280 if kind == "mamba1" else 32768)


def _getter(config: dict):
    """get(key, default, kind): config[key] (or default) checked to be a positive int, a float, a bool or a str."""
    def get(key: str, default: Any, kind: type = int) -> Any:
        value = config.get(key, default)
        if kind is float and type(value) is int:
            value = float(value)
        bad = type(value) is not kind or (kind is int and value < 1) or (kind is float and not math.isfinite(value))
        if bad:
            what = {int: "a positive integer", float: "a finite number", bool: "true or false", str: "a string"}
            raise MambactlError(f"config.json: {key} must be {what[kind]}, got {value!r}")
        return value
    return get


def _dt_limit(value: Any) -> list[float]:
    """HF's time_step_limit: [lo, hi], hi possibly Infinity or transformers 5's {"__float__": "Infinity"}."""
    def number(v: Any) -> Any:
        if isinstance(v, dict) and set(v) == {"__float__"} and v["__float__"] in ("Infinity", "inf"):
            return math.inf
        return v

    if value is None:
        return [0.0, math.inf]
    items = [number(v) for v in value] if isinstance(value, list) else []
    if not (len(items) == 2 and all(type(v) in (int, float) for v in items)):
        raise MambactlError(f"config.json: time_step_limit must be [lo, hi], got {value!r}")
    return [float(v) for v in items]


# import ---------------------------------------------------------------------------------------------------------
def import_checkpoint(src: str | Path, out: str | Path, *, tokenizer: str | Path | None = None,
                      name: str | None = None, version: str = "0.1.0") -> dict:
    """Import a transformers or mamba_ssm model directory as a float32 `.evermind` package; return its manifest.

    tokenizer: any file or directory `load_tokenizer` reads (default: the tokenizer in `src`).
    """
    src = Path(src)
    if not src.is_dir():
        raise MambactlError(f"{src}: not a directory (expected a transformers or mamba_ssm model directory)")
    config = _read_json(src / "config.json")
    mamba_ssm = is_mamba_ssm_config(config)
    try:
        if mamba_ssm:  # attention: the indices of MHA layers (mamba_ssm hybrids)
            fields, kind, rows, attention = model_from_mamba_ssm(config)
        else:
            (fields, kind, rows), attention = model_from_hf(config), ()
    except MambactlError as exc:
        raise MambactlError(f"{src}/{exc}") from None
    source = "mamba_ssm" if mamba_ssm else ARCHITECTURES[kind][0]
    tensors = read_tensors(src)
    tok = _tokenizer(src, tokenizer)
    cfg = _model_config(src, fields, kind, attention, vocab_size(tok), rows, len(tensors))
    weights = _match_tensors(src, cfg, tensors, renames=tensor_renames(attention) if mamba_ssm else ())
    card = {"description": f"Imported from the {source} checkpoint {src.name}.", "tags": ["imported", source]}
    return write_package(out, cfg, weights, tok, name=name or src.name, version=version, card=card)


def _tokenizer(src: Path, path: str | Path | None) -> Tokenizer:
    if path is None and not any((src / f).is_file() for f in ("tokenizer.json", "vocab.json")):
        raise MambactlError(f"{src}: no tokenizer.json; pass --tokenizer (mamba_ssm releases use "
                            "EleutherAI/gpt-neox-20b's tokenizer.json)")
    return load_tokenizer(src if path is None else path)


def _model_config(src: Path, fields: dict, kind: str, attention: tuple[int, ...], tokens: int, rows: int,
                  n_tensors: int) -> ModelConfig:
    """The package config: layers `kind` but those in `attention`; the tokenizer's vocab padded to exactly the
    checkpoint's embedding rows."""
    if fields["n_layer"] > n_tensors:  # before building a per-layer list from an absurd n_layer
        raise MambactlError(f"{src}/config.json: {fields['n_layer']} layers, but the checkpoint holds only "
                            f"{n_tensors} tensors")
    if tokens > rows:
        raise MambactlError(f"{src}: the tokenizer has {tokens} tokens but {EMBED} has {rows} rows; "
                            "use the tokenizer the model was trained with")
    declared = fields.get("pad_vocab_size_multiple")
    multiple = next(m for m in (declared, *_PAD_MULTIPLES, rows) if m and -(-tokens // m) * m == rows)
    data = {**fields, "vocab_size": tokens, "pad_vocab_size_multiple": multiple, "tie_embeddings": True,
            "layers": ["attention" if i in attention else kind for i in range(fields["n_layer"])]}
    return config_from_dict(data, f"{src}/config.json")


def _match_tensors(src: Path, cfg: ModelConfig, tensors: dict[str, np.ndarray],
                   renames: tuple[tuple[str, str], ...]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors by parameter name, each checked against `parameter_specs(cfg)`.

    renames: (checkpoint prefix, parameter prefix) pairs. A stored lm_head.weight must equal the embedding:
    mambactl's head is tied.
    """
    def ours(n: str) -> str:
        return next((our + n[len(theirs):] for theirs, our in renames if n.startswith(theirs)), n)

    def theirs(n: str) -> str:
        return next((their + n[len(our):] for their, our in renames if n.startswith(our)), n)

    named = {ours(n): t for n, t in tensors.items()}
    head = named.pop(HEAD, None)
    weights = {}
    for spec in parameter_specs(cfg):
        if spec.name not in named:
            raise MambactlError(f"{src}: missing tensor {theirs(spec.name)} (expected shape {list(spec.shape)})")
        if named[spec.name].shape != spec.shape:
            raise MambactlError(f"{src}: tensor {theirs(spec.name)} has shape {list(named[spec.name].shape)}; "
                                f"expected {list(spec.shape)}")
        weights[spec.name] = named.pop(spec.name)
    if named:
        extra = theirs(sorted(named)[0])
        kinds = "/".join(dict.fromkeys(cfg.layers))
        raise MambactlError(f"{src}: unexpected tensor {extra} (not a parameter of this {kinds} model)")
    if head is not None and not np.array_equal(head, weights[EMBED]):
        raise MambactlError(f"{src}: {HEAD} differs from {theirs(EMBED)}; untied output heads are not supported")
    return weights


# export ---------------------------------------------------------------------------------------------------------
def special_tokens(tok: Tokenizer) -> dict[str, tuple[str, int] | None]:
    """The tokenizer's special tokens in the roles HF and llama.cpp name: {"bos", "eos", "pad", "unk": (token, id)
    or None}. GPT-NeoX convention: bos = eos = <|endoftext|>; pad falls back to eos."""
    specials = tokenizer_summary(tok)["specials"]

    def first(*names: str) -> tuple[str, int] | None:
        return next(((n, specials[n]) for n in names if n in specials), None)

    eos = first("<|endoftext|>", "</s>", "<eos>", "<|eos|>")
    return {"bos": first("<s>", "<bos>", "<|startoftext|>") or eos, "eos": eos,
            "pad": first("<|padding|>", "<pad>", "<|pad|>", "[PAD]") or eos, "unk": first("<unk>", "[UNK]")}


def single_layer_type(cfg: ModelConfig, target: str) -> str:
    """The one layer type of a model; `target` (e.g. "transformers") names who cannot represent a mix."""
    kinds = sorted(set(cfg.layers))
    if len(kinds) != 1:
        raise MambactlError(f"{target} has no model mixing layer types ({', '.join(kinds)})")
    return kinds[0]


def hf_config(cfg: ModelConfig, tok: Tokenizer) -> dict:
    """config.json of the HF MambaConfig / Mamba2Config equal to `cfg` (vocab_size = the padded embedding rows)."""
    kind = single_layer_type(cfg, "transformers")
    arch, model_type = ARCHITECTURES[kind]
    ids = {role: (t[1] if t else None) for role, t in special_tokens(tok).items()}
    common = {
        "architectures": [arch], "model_type": model_type, "vocab_size": cfg.padded_vocab_size,
        "pad_vocab_size_multiple": cfg.pad_vocab_size_multiple, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layer, "layer_norm_epsilon": cfg.norm_eps, "hidden_act": "silu",
        "initializer_range": 0.1, "residual_in_fp32": True, "rescale_prenorm_residual": False, "use_cache": True,
        "tie_word_embeddings": True, "bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"], "dtype": "float32",
    }
    if kind == "mamba1":
        m = cfg.mamba1
        return common | {
            "state_size": m.d_state, "expand": m.expand, "intermediate_size": cfg.d_inner, "conv_kernel": m.d_conv,
            "time_step_rank": cfg.dt_rank, "use_bias": m.bias, "use_conv_bias": m.conv_bias,
            "time_step_scale": 1.0, "time_step_min": m.dt_min, "time_step_max": m.dt_max,
            "time_step_floor": m.dt_init_floor, "time_step_init_scheme": "random", "use_mambapy": False,
        }
    m2 = cfg.mamba2
    return common | {
        "state_size": m2.d_state, "expand": m2.expand, "conv_kernel": m2.d_conv, "head_dim": m2.headdim,
        "num_heads": cfg.mamba2_nheads, "n_groups": m2.ngroups, "chunk_size": m2.chunk_size,
        "use_bias": m2.bias, "use_conv_bias": m2.conv_bias, "time_step_rank": math.ceil(cfg.d_model / 16),
        "time_step_min": m2.dt_min, "time_step_max": m2.dt_max, "time_step_floor": m2.dt_init_floor,
        "time_step_limit": list(m2.dt_limit_inf),
    }


def export_hf(package: Package, out_dir: str | Path) -> list[Path]:
    """Write `package` as a transformers model directory (created if missing); return the files written."""
    out_dir = Path(out_dir)
    config = hf_config(package.config, package.tokenizer)  # refuses what transformers cannot hold, first
    if out_dir.exists() and not out_dir.is_dir():
        raise MambactlError(f"{out_dir}: exists and is not a directory")
    if not out_dir.parent.is_dir():
        raise MambactlError(f"{out_dir}: directory {out_dir.parent} does not exist")
    out_dir.mkdir(exist_ok=True)
    specials = {f"{role}_token": t[0] for role, t in special_tokens(package.tokenizer).items() if t}
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "add_bos_token": False,
                        "add_eos_token": False, "clean_up_tokenization_spaces": False}
    weights = {k: np.ascontiguousarray(v, np.float32) for k, v in package.weights.items()}
    files = {
        "config.json": _json_bytes(config),
        "model.safetensors": safetensors.numpy.save(weights, metadata={"format": "pt"}),
        "tokenizer.json": package.tokenizer.to_str().encode("utf-8"),
        "tokenizer_config.json": _json_bytes(tokenizer_config),
        "special_tokens_map.json": _json_bytes(specials),
    }
    for file_name, data in files.items():
        atomic_write(out_dir / file_name, [data])
    return [out_dir / f for f in files]


def _json_bytes(data: dict) -> bytes:
    """Indented JSON as transformers writes it (an infinite time_step_limit bound is written as Infinity)."""
    return (json.dumps(data, indent=2) + "\n").encode("utf-8")
