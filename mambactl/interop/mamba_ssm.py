"""mamba_ssm release checkpoints: their config.json, and the `pytorch_model.bin` they ship, read without torch.

A state-spaces directory (e.g. `state-spaces/mamba-130m`) holds a config.json of `mamba_ssm.models.config_mamba.
MambaConfig` fields (`d_model`, `n_layer`, `vocab_size`, `ssm_cfg`, `pad_vocab_size_multiple`, ...) and a
`pytorch_model.bin` with `backbone.embedding.weight` (singular), `backbone.layers.{i}.{norm,mixer.*}`,
`backbone.norm_f.weight` and the tied `lm_head.weight`.

`read_torch_checkpoint` reads torch's zip format (torch >= 1.6) without unpickling code: `data.pkl` is
interpreted opcode by opcode (`pickletools.genops` parses it; nothing is executed), accepting only the opcodes and
globals a `torch.save(state_dict)` of float tensors uses (`collections.OrderedDict`, `torch._utils.
_rebuild_tensor_v2`, `torch._utils._rebuild_parameter`, `torch.{Float,Half,BFloat16,Double}Storage`), with every
storage read from its zip entry and every view bounds-checked against it. Anything else is refused in one line.
"""

from __future__ import annotations

import math
import pickletools
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mambactl.errors import MambactlError
from mambactl.package.checkpoint import first_line, require_file

# mamba_ssm spells the embedding `embedding`; HF (and mambactl) `embeddings` (HF's MambaModel load hook renames it).
RENAMES = (("backbone.embedding.", "backbone.embeddings."),)

# mamba_ssm `Mamba` / `Mamba2` arguments mambactl's config keeps, and those that only choose kernels or init schemes.
_MAMBA1_KEYS = {"d_state", "d_conv", "expand", "dt_rank", "dt_min", "dt_max", "dt_init_floor", "bias", "conv_bias"}
_MAMBA2_KEYS = {"d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "A_init_range", "dt_min",
                "dt_max", "dt_init_floor", "dt_limit", "bias", "conv_bias"}
_INERT_KEYS = {"dt_init", "dt_scale", "conv_init", "use_fast_path", "use_mem_eff_path", "layer_idx",
               "process_group", "sequence_parallel"}
# Mamba-2 variants mambactl's block does not compute: key -> the value it must have.
_MAMBA2_FIXED = {"rmsnorm": True, "norm_before_gate": False, "D_has_hdim": False}


# config ---------------------------------------------------------------------------------------------------------
def is_mamba_ssm_config(config: dict) -> bool:
    """True for a mamba_ssm MambaConfig dict (d_model / n_layer / ssm_cfg), false for a transformers config."""
    return "model_type" not in config and "d_model" in config and "n_layer" in config


def model_from_mamba_ssm(config: dict) -> tuple[dict, str, int]:
    """A mamba_ssm config.json -> (ModelConfig fields but vocab_size and layers, the layer type of every layer,
    the embedding rows the checkpoint stores).

    The rows are `vocab_size` padded up to `pad_vocab_size_multiple`, as mamba_ssm's MambaLMHeadModel does.
    Features mambactl's model lacks (attention layers, MLPs, LayerNorm, Mamba-3, ...) are refused by name.
    """
    def get(key: str, default: Any, kind: type = int) -> Any:
        value = config.get(key, default)
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 1)):
            raise MambactlError(f"config.json: {key} must be {_KIND_NAMES[kind]}, got {value!r}")
        return value

    d_model, n_layer = get("d_model", None), get("n_layer", None)
    vocab, multiple = get("vocab_size", None), get("pad_vocab_size_multiple", 8)
    if config.get("d_intermediate", 0) != 0:
        raise MambactlError("config.json: d_intermediate != 0 (MLP blocks) is not supported; mambactl models are "
                            "pure Mamba stacks")
    if get("attn_layer_idx", [], list):
        raise MambactlError("config.json: attn_layer_idx is not empty; attention layers are not supported")
    if not get("rms_norm", True, bool):
        raise MambactlError("config.json: rms_norm is false (LayerNorm); mambactl models use RMSNorm")
    ssm = dict(get("ssm_cfg", {}, dict))
    layer = ssm.pop("layer", "Mamba1")
    if layer == "Mamba1":
        kind, known = "mamba1", _MAMBA1_KEYS
    elif layer == "Mamba2":
        kind, known = "mamba2", _MAMBA2_KEYS
        for key, value in _MAMBA2_FIXED.items():
            if ssm.pop(key, value) != value:
                raise MambactlError(f"config.json: ssm_cfg.{key} = {not value} is not supported (mambactl's Mamba-2 "
                                    "has a gated RMSNorm, gate before norm, one D per head)")
        d_ssm = ssm.pop("d_ssm", None)
        if d_ssm is not None and d_ssm != ssm.get("expand", 2) * d_model:
            raise MambactlError("config.json: ssm_cfg.d_ssm != expand * d_model (a gated-MLP part) is not supported")
    else:
        raise MambactlError(f"config.json: unsupported architecture: ssm_cfg.layer = {layer!r} "
                            "(mambactl imports Mamba1 and Mamba2 layers)")
    unknown = sorted(set(ssm) - known - _INERT_KEYS)
    if unknown:
        raise MambactlError(f"config.json: ssm_cfg.{unknown[0]} is not a {layer} setting mambactl knows")
    model = {"d_model": d_model, "n_layer": n_layer, "norm_eps": 1e-5, "pad_vocab_size_multiple": multiple,
             "tie_embeddings": get("tie_embeddings", True, bool), kind: {k: v for k, v in ssm.items() if k in known}}
    return model, kind, _pad(vocab, multiple)


_KIND_NAMES = {int: "a positive integer", bool: "true or false", dict: "an object", list: "a list"}


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# torch zip checkpoints ------------------------------------------------------------------------------------------
_STORAGES = {"FloatStorage": np.dtype("<f4"), "HalfStorage": np.dtype("<f2"), "DoubleStorage": np.dtype("<f8"),
             "BFloat16Storage": np.dtype("<u2")}  # bfloat16 is read as its raw bits, widened at the end
_REBUILD_TENSOR, _REBUILD_PARAMETER, _ORDERED_DICT = object(), object(), object()
_GLOBALS = {("collections", "OrderedDict"): _ORDERED_DICT,
            ("torch._utils", "_rebuild_tensor_v2"): _REBUILD_TENSOR,
            ("torch._utils", "_rebuild_parameter"): _REBUILD_PARAMETER,
            **{("torch", name): ("storage-type", name) for name in _STORAGES}}


@dataclass(frozen=True)
class _Storage:
    """One storage of the checkpoint: a flat array of its dtype, read from `<archive>/data/<key>`."""

    data: np.ndarray
    kind: str  # a key of _STORAGES


@dataclass(frozen=True)
class _Tensor:
    """A rebuilt tensor: its values (a copy) in the storage's dtype."""

    array: np.ndarray
    kind: str


def read_torch_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """A `torch.save(state_dict)` file (zip format) -> {name: float32 array}, executing no pickled code."""
    require_file(path)
    if not zipfile.is_zipfile(path):
        raise MambactlError(f"{path}: not a zip-format torch checkpoint (legacy torch < 1.6 files are not read; "
                            "re-save it with a recent torch or convert it to safetensors)")
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pickles) != 1:
                raise MambactlError("expected exactly one <name>/data.pkl in the archive")
            prefix = pickles[0][: -len("data.pkl")]
            byteorder = prefix + "byteorder"
            if byteorder in archive.namelist() and archive.read(byteorder).strip() != b"little":
                raise MambactlError("big-endian checkpoints are not supported")
            state = _Unpickler(archive, prefix).load(archive.read(pickles[0]))
    except MambactlError as exc:
        raise MambactlError(f"{path}: {exc}") from None
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, IndexError, TypeError) as exc:  # malformed
        raise MambactlError(f"{path}: unreadable torch checkpoint ({first_line(exc)})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, _Tensor) for k, v in state.items()):
        raise MambactlError(f"{path}: expected a state dict {{name: tensor}} at the top level")
    return {name: _widen(t) for name, t in state.items()}


def _widen(t: _Tensor) -> np.ndarray:
    if t.kind == "BFloat16Storage":
        return (t.array.astype(np.uint32) << 16).view(np.float32)
    return t.array.astype(np.float32)


class _Unpickler:
    """A stack machine for the pickle subset `torch.save` writes for a state dict of float tensors."""

    def __init__(self, archive: zipfile.ZipFile, prefix: str):
        self.archive, self.prefix = archive, prefix
        self.storages: dict[str, _Storage] = {}

    def load(self, data: bytes) -> Any:
        stack: list[Any] = []
        marks: list[int] = []
        memo: dict[int, Any] = {}
        for op, arg, pos in pickletools.genops(data):
            name = op.name
            if name in ("PROTO", "FRAME"):
                continue
            if name == "STOP":
                if len(stack) != 1:
                    raise MambactlError("data.pkl: malformed pickle (stack not empty at STOP)")
                return stack[0]
            if name in ("BINUNICODE", "SHORT_BINUNICODE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT"):
                stack.append(arg)
            elif name in ("NEWTRUE", "NEWFALSE", "NONE"):
                stack.append({"NEWTRUE": True, "NEWFALSE": False, "NONE": None}[name])
            elif name in ("EMPTY_TUPLE", "EMPTY_DICT", "EMPTY_LIST"):
                stack.append({"EMPTY_TUPLE": (), "EMPTY_DICT": {}, "EMPTY_LIST": []}[name])
            elif name == "MARK":
                marks.append(len(stack))
            elif name in ("TUPLE", "LIST"):
                start = marks.pop()
                items = stack[start:]
                del stack[start:]
                stack.append(tuple(items) if name == "TUPLE" else items)
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
            elif name in ("BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name in ("GLOBAL", "STACK_GLOBAL"):
                if name == "GLOBAL":
                    module, _, attr = arg.partition(" ")
                else:
                    module, attr = stack.pop(-2), stack.pop()
                if (module, attr) not in _GLOBALS:
                    raise MambactlError(f"data.pkl refers to {module}.{attr}, which a state dict of float "
                                        "tensors does not need; refusing to read it")
                stack.append(_GLOBALS[(module, attr)])
            elif name == "BINPERSID":
                stack.append(self._storage(stack.pop()))
            elif name == "REDUCE":
                args = stack.pop()
                stack.append(self._call(stack.pop(), args))
            elif name in ("SETITEM", "SETITEMS"):
                start = marks.pop() if name == "SETITEMS" else len(stack) - 2
                items = stack[start:]
                del stack[start:]
                target = stack[-1]
                if not isinstance(target, dict):
                    raise MambactlError("data.pkl: malformed pickle (SETITEMS on a non-dict)")
                target.update(zip(items[::2], items[1::2]))
            elif name in ("APPEND", "APPENDS"):
                start = marks.pop() if name == "APPENDS" else len(stack) - 1
                items = stack[start:]
                del stack[start:]
                if not isinstance(stack[-1], list):
                    raise MambactlError("data.pkl: malformed pickle (APPENDS on a non-list)")
                stack[-1].extend(items)
            else:
                raise MambactlError(f"data.pkl uses pickle opcode {name} at byte {pos}, outside the subset "
                                    "torch.save writes for a state dict; refusing to read it")
        raise MambactlError("data.pkl: pickle ends without STOP")

    def _call(self, func: Any, args: Any) -> Any:
        if not isinstance(args, tuple):
            raise MambactlError("data.pkl: malformed pickle (REDUCE arguments are not a tuple)")
        if func is _ORDERED_DICT and args == ():
            return {}
        if func is _REBUILD_TENSOR and 6 <= len(args) <= 7:
            return _rebuild_tensor(*args[:4])
        if func is _REBUILD_PARAMETER and len(args) == 3 and isinstance(args[0], _Tensor):
            return args[0]
        raise MambactlError("data.pkl: unexpected call in the pickle; refusing to read it")

    def _storage(self, pid: Any) -> _Storage:
        """('storage', ('storage-type', Kind), key, location, numel) -> the storage, read once per key."""
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], tuple)
                and len(pid[1]) == 2 and pid[1][0] == "storage-type" and isinstance(pid[2], str)
                and type(pid[4]) is int and pid[4] >= 0):
            raise MambactlError("data.pkl: unsupported persistent id (only float tensor storages are read)")
        kind, key, numel = pid[1][1], pid[2], pid[4]
        if key not in self.storages:
            entry, dtype = f"{self.prefix}data/{key}", _STORAGES[kind]
            size = self.archive.getinfo(entry).file_size  # checked before anything is read
            if size != numel * dtype.itemsize:
                raise MambactlError(f"storage {key} holds {size} bytes; {numel} × {kind} needs "
                                    f"{numel * dtype.itemsize}")
            self.storages[key] = _Storage(np.frombuffer(self.archive.read(entry), dtype=dtype), kind)
        storage = self.storages[key]
        if storage.kind != kind:
            raise MambactlError(f"storage {key} is read both as {storage.kind} and as {kind}")
        return storage


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any) -> _Tensor:
    """torch._utils._rebuild_tensor_v2 for a view (offset, size, stride in elements) of a storage, copied out."""
    ok = (isinstance(storage, _Storage) and type(offset) is int and offset >= 0
          and isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride)
          and all(type(v) is int and v >= 0 for v in size + stride))
    if not ok:
        raise MambactlError("data.pkl: malformed tensor (storage, offset, size, stride)")
    data = storage.data
    if math.prod(size) == 0:
        return _Tensor(np.zeros(size, data.dtype), storage.kind)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= data.size or math.prod(size) > data.size:  # the second: no stride-0 blow-up of a small storage
        raise MambactlError(f"data.pkl: a tensor of size {list(size)} does not fit its storage "
                            f"({data.size} elements)")
    view = np.lib.stride_tricks.as_strided(data[offset:], shape=size,
                                          strides=tuple(s * data.itemsize for s in stride), writeable=False)
    return _Tensor(np.array(view), storage.kind)
