"""Export a package as GGUF v3 for llama.cpp, with mambactl's own writer (no gguf package needed).

What llama.cpp's converter (convert_hf_to_gguf.py, `MambaModel` / `Mamba2Model`) writes, and its loader reads:

- `general.architecture` "mamba" or "mamba2"; `{arch}.context_length` (2^20 placeholder), `embedding_length`,
  `block_count`, `feed_forward_length` = 0 and `attention.head_count` = 0 (unused but required),
  `ssm.conv_kernel`, `ssm.inner_size`, `ssm.state_size`, `ssm.time_step_rank` (Mamba-2: the number of heads),
  `ssm.group_count` (Mamba-2), `ssm.dt_b_c_rms` = false (Mamba-1), `attention.layer_norm_rms_epsilon`.
- Tensors (numpy shapes; GGUF stores the dims reversed): `token_embd.weight` [V_padded, d], per layer
  `blk.N.attn_norm.weight` [d], `ssm_in.weight`, `ssm_conv1d.weight` [conv_dim, k] (squeezed) + `.bias`,
  Mamba-1: `ssm_x.weight`, `ssm_dt.weight` + `.bias`, `ssm_a` [d_in, N] = −exp(A_log), `ssm_d` [d_in];
  Mamba-2: `ssm_dt.bias` [H] (dt_bias), `ssm_a` [H, 1] = −exp(A_log), `ssm_d` [H, 1],
  `ssm_norm.weight` [G, d_in / G]; `ssm_out.weight`; then `output_norm.weight`. The head is tied: no `output`.
- F16 files keep llama.cpp's F32 exceptions: 1-D tensors, norms, the conv, `ssm_a` / `ssm_d`, biases.
- Tokenizer: `tokenizer.ggml.model` "gpt2", `pre`, `tokens` (byte-level strings by id, padded to the embedding
  rows with "[PAD{id}]"), `token_type` (1 normal, 3 control, 4 user-defined, 5 unused), `merges` ("a b"),
  bos/eos/padding (/unknown) ids, `add_bos_token` = false.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from mambactl.errors import MambactlError
from mambactl.interop.hf import single_layer_type, special_tokens
from mambactl.models.config import ModelConfig
from mambactl.package.checkpoint import atomic_write
from mambactl.package.evermind import Package

MAGIC, VERSION, ALIGNMENT = b"GGUF", 3, 32
# GGUF value types (gguf.md)
UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9
_SCALAR = {UINT32: "<I", INT32: "<i", FLOAT32: "<f", BOOL: "<?"}
# ggml tensor types and llama.cpp file types
GGML_F32, GGML_F16 = 0, 1
_ITEMSIZE = {GGML_F32: 4, GGML_F16: 2}
FILE_TYPES = {"f32": (0, GGML_F32), "f16": (1, GGML_F16)}  # --dtype -> (general.file_type, 2-D weight type)
ARCH = {"mamba1": "mamba", "mamba2": "mamba2"}
# token types (llama.cpp's llama_token_type)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

Metadata = list[tuple[str, int, Any]]  # (key, value type, value); an ARRAY value is (element type, items)


# model ----------------------------------------------------------------------------------------------------------
def gguf_tensors(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """The package's parameters under llama.cpp's names and layouts, float32, in file order."""
    kind = single_layer_type(cfg, "GGUF")
    mixer = cfg.mamba1 if kind == "mamba1" else cfg.mamba2
    if mixer.expand != 2:
        raise MambactlError(f"llama.cpp's {ARCH[kind]} supports expand = 2 only (this model has {mixer.expand})")
    if mixer.bias:
        raise MambactlError(f"llama.cpp's {ARCH[kind]} has no in_proj/out_proj bias (this model has bias = true)")
    w = {k: np.asarray(v, np.float32) for k, v in weights.items()}
    out = [("token_embd.weight", w["backbone.embeddings.weight"])]
    for i in range(cfg.n_layer):
        p, b = f"backbone.layers.{i}.mixer.", f"blk.{i}."
        conv = w[p + "conv1d.weight"][:, 0, :]
        conv_bias = w[p + "conv1d.bias"] if mixer.conv_bias else np.zeros(conv.shape[0], np.float32)
        out += [(b + "attn_norm.weight", w[f"backbone.layers.{i}.norm.weight"]),
                (b + "ssm_in.weight", w[p + "in_proj.weight"]),
                (b + "ssm_conv1d.weight", conv), (b + "ssm_conv1d.bias", conv_bias)]
        if kind == "mamba1":
            out += [(b + "ssm_x.weight", w[p + "x_proj.weight"]),
                    (b + "ssm_dt.weight", w[p + "dt_proj.weight"]), (b + "ssm_dt.bias", w[p + "dt_proj.bias"]),
                    (b + "ssm_a", -np.exp(w[p + "A_log"])), (b + "ssm_d", w[p + "D"])]
        else:
            G = cfg.mamba2.ngroups
            out += [(b + "ssm_dt.bias", w[p + "dt_bias"]),
                    (b + "ssm_a", -np.exp(w[p + "A_log"])[:, None]), (b + "ssm_d", w[p + "D"][:, None]),
                    (b + "ssm_norm.weight", w[p + "norm.weight"].reshape(G, -1))]
        out.append((b + "ssm_out.weight", w[p + "out_proj.weight"]))
    out.append(("output_norm.weight", w["backbone.norm_f.weight"]))
    return out


def _stored_type(name: str, array: np.ndarray, weight_type: int) -> int:
    """llama.cpp's converter rule: only 2-D `.weight` matrices other than norms and the conv take the file type."""
    matrix = array.ndim >= 2 and name.endswith(".weight") and not name.endswith("_norm.weight")
    return weight_type if matrix and ".ssm_conv1d." not in name else GGML_F32


def model_metadata(cfg: ModelConfig, name: str, file_type: int) -> Metadata:
    """general.* and {arch}.* keys."""
    kind = single_layer_type(cfg, "GGUF")
    arch = ARCH[kind]
    meta: Metadata = [
        ("general.architecture", STRING, arch),
        ("general.name", STRING, name),
        ("general.file_type", UINT32, file_type),
        ("general.quantization_version", UINT32, 2),
        (f"{arch}.context_length", UINT32, 2 ** 20),
        (f"{arch}.embedding_length", UINT32, cfg.d_model),
        (f"{arch}.block_count", UINT32, cfg.n_layer),
        (f"{arch}.feed_forward_length", UINT32, 0),
        (f"{arch}.attention.head_count", UINT32, 0),
    ]
    if kind == "mamba1":
        m = cfg.mamba1
        meta += [(f"{arch}.ssm.conv_kernel", UINT32, m.d_conv), (f"{arch}.ssm.inner_size", UINT32, cfg.d_inner),
                 (f"{arch}.ssm.state_size", UINT32, m.d_state), (f"{arch}.ssm.time_step_rank", UINT32, cfg.dt_rank),
                 (f"{arch}.ssm.dt_b_c_rms", BOOL, False)]
    else:
        m2 = cfg.mamba2
        meta += [(f"{arch}.ssm.conv_kernel", UINT32, m2.d_conv),
                 (f"{arch}.ssm.inner_size", UINT32, cfg.mamba2_d_inner),
                 (f"{arch}.ssm.state_size", UINT32, m2.d_state),
                 (f"{arch}.ssm.time_step_rank", UINT32, cfg.mamba2_nheads),
                 (f"{arch}.ssm.group_count", UINT32, m2.ngroups)]
    meta.append((f"{arch}.attention.layer_norm_rms_epsilon", FLOAT32, cfg.norm_eps))
    return meta


# tokenizer ------------------------------------------------------------------------------------------------------
def tokenizer_metadata(tok: Tokenizer, rows: int) -> Metadata:
    """tokenizer.ggml.* keys of a byte-level BPE, its token list padded to the embedding's `rows`."""
    data = json.loads(tok.to_str())
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=False).items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(rows):
        if i in added:
            tokens.append(added[i].content)
            types.append(CONTROL if added[i].special else USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    meta: Metadata = [
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.pre", STRING, llama_cpp_pre(data)),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
        ("tokenizer.ggml.token_type", ARRAY, (INT32, types)),
        ("tokenizer.ggml.merges", ARRAY, (STRING, merges)),
    ]
    ids = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
    for role, special in special_tokens(tok).items():
        if special is not None:
            meta.append((f"tokenizer.ggml.{ids[role]}", UINT32, special[1]))
    meta.append(("tokenizer.ggml.add_bos_token", BOOL, False))
    return meta


def llama_cpp_pre(tokenizer_json: dict) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer: "gpt-2" for GPT-2's ByteLevel regex, else "default"
    (llama.cpp then splits with its default regex, which may tokenize some text differently)."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    gpt2 = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
    return "gpt-2" if gpt2 else "default"


# writing --------------------------------------------------------------------------------------------------------
def export_gguf(package: Package, path: str | Path, dtype: str = "f32") -> dict:
    """Write `package` as a GGUF v3 file; return {"architecture", "tensors", "file_type", "pre"}."""
    if dtype not in FILE_TYPES:
        raise MambactlError(f"GGUF dtype {dtype!r} is not one of {', '.join(FILE_TYPES)}")
    file_type, weight_type = FILE_TYPES[dtype]
    cfg = package.config
    tensors = gguf_tensors(cfg, package.weights)
    meta = model_metadata(cfg, package.manifest["name"], file_type) + tokenizer_metadata(
        package.tokenizer, cfg.padded_vocab_size)
    typed = [(n, a, _stored_type(n, a, weight_type)) for n, a in tensors]
    atomic_write(Path(path), write_gguf(meta, typed))
    return {"architecture": meta[0][2], "tensors": len(typed), "file_type": dtype.upper(),
            "pre": next(v for k, _, v in meta if k == "tokenizer.ggml.pre")}


def write_gguf(metadata: Metadata, tensors: list[tuple[str, np.ndarray, int]]) -> Iterator[bytes]:
    """The bytes of a GGUF v3 file, in chunks: header, metadata, tensor infos, then the aligned tensor data.

    tensors: (name, array in numpy order, ggml type GGML_F32 / GGML_F16); GGUF dims are the shape reversed.
    """
    head = [MAGIC, struct.pack("<IQQ", VERSION, len(tensors), len(metadata))]
    for key, vtype, value in metadata:
        head += [_string(key), struct.pack("<I", vtype), _value(vtype, value)]
    offset = 0
    for name, array, ggml_type in tensors:
        if len(name.encode("utf-8")) > 64:
            raise MambactlError(f"GGUF tensor name {name!r} is longer than 64 bytes")
        head += [_string(name), struct.pack("<I", array.ndim), struct.pack(f"<{array.ndim}Q", *array.shape[::-1]),
                 struct.pack("<IQ", ggml_type, offset)]
        offset += _aligned(array.size * _ITEMSIZE[ggml_type])
    header = b"".join(head)
    yield header + bytes(_aligned(len(header)) - len(header))
    for _, array, ggml_type in tensors:  # one tensor converted at a time
        blob = np.ascontiguousarray(array, "<f4" if ggml_type == GGML_F32 else "<f2").tobytes()
        yield blob + bytes(_aligned(len(blob)) - len(blob))


def _aligned(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, value: Any) -> bytes:
    if vtype == STRING:
        return _string(value)
    if vtype == ARRAY:
        etype, items = value
        head = struct.pack("<IQ", etype, len(items))
        if etype == STRING:
            return head + b"".join(map(_string, items))
        return head + np.asarray(items, _SCALAR[etype]).tobytes()
    return struct.pack(_SCALAR[vtype], value)
