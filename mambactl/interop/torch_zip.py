"""PyTorch's zip checkpoint format (torch >= 1.6): read without unpickling code, write without torch.

An archive `<name>/` holds `data.pkl` (the pickled state dict), one entry `data/<key>` of raw little-endian bytes
per storage, `byteorder` ("little") and `version` ("3").

`read_torch_checkpoint` interprets `data.pkl` opcode by opcode (`pickletools.genops` parses it; nothing is
executed), accepting only the opcodes and globals a `torch.save(state_dict)` of float tensors uses
(`collections.OrderedDict`, `torch._utils._rebuild_tensor_v2`, `torch._utils._rebuild_parameter`,
`torch.{Float,Half,BFloat16,Double}Storage`, and the BUILD that attaches a state dict's `_metadata`, which is
dropped), with every storage read from its zip entry and every view bounds-checked against it. Anything else is
refused in one line.

`write_torch_checkpoint` writes float32 tensors as `torch.save(OrderedDict)` does: a protocol-2 pickle written
opcode by opcode (an OrderedDict of `_rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())` with
persistent ids `('storage', torch.FloatStorage, key, 'cpu', numel)`), stored (uncompressed) entries and storages
aligned to 64 bytes in the file, as torch's writer aligns them (so `torch.load(..., mmap=True)` maps them in place).
`torch.load(path, weights_only=True)` reads it.
"""

from __future__ import annotations

import math
import pickletools
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mambactl.errors import MambactlError
from mambactl.package.checkpoint import first_line, require_file


# reading ----------------------------------------------------------------------------------------------------------
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
            elif name == "BUILD":  # a state_dict()'s `_metadata` (module versions), set as an attribute: dropped
                state = stack.pop()
                if not (isinstance(stack[-1], dict) and isinstance(state, dict)
                        and all(isinstance(k, str) for k in state)):
                    raise MambactlError("data.pkl: malformed pickle (BUILD is only read for a state dict's "
                                        "metadata)")
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


# writing ----------------------------------------------------------------------------------------------------------
_ARCHIVE = "archive"
_ALIGNMENT = 64  # torch's writer aligns each storage's bytes to 64 in the file
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # reproducible bytes, as torch's writer (miniz) stores no real times


def write_torch_checkpoint(path: Path, tensors: dict[str, np.ndarray], ties: dict[str, str] | None = None) -> None:
    """Write `tensors` ({name: array}, in order) as float32 to `path`, loadable by `torch.load(weights_only=True)`.

    ties: {name: other name} for tensors that share the other's storage (written once, as torch.save writes a
    tied lm_head.weight); each tied name must also be a key of `tensors` holding an equal array.
    """
    ties = ties or {}
    keys: dict[str, str] = {}  # tensor name -> storage key
    storages: list[np.ndarray] = []
    for name, array in tensors.items():
        if name in ties:
            keys[name] = keys[ties[name]]
            continue
        keys[name] = str(len(storages))
        storages.append(np.ascontiguousarray(array, dtype="<f4"))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        _write_entry(archive, "data.pkl", _state_dict_pickle(tensors, keys))
        _write_entry(archive, "byteorder", b"little")
        for key, data in enumerate(storages):
            _write_entry(archive, f"data/{key}", data.tobytes())
        _write_entry(archive, "version", b"3\n")


def _write_entry(archive: zipfile.ZipFile, name: str, data: bytes) -> None:
    """One stored entry of `archive/`, its data starting at a multiple of _ALIGNMENT (padding in the extra field,
    id "FB", as torch's writer pads)."""
    info = zipfile.ZipInfo(f"{_ARCHIVE}/{name}", date_time=_FIXED_TIME)
    info.compress_type = zipfile.ZIP_STORED
    header_end = archive.fp.tell() + 30 + len(info.filename.encode("utf-8"))  # local header: 30 bytes + name
    if len(data) * 1.05 > zipfile.ZIP64_LIMIT:  # zipfile then appends a 20-byte zip64 field after ours
        header_end += 20
    pad = -(header_end + 4) % _ALIGNMENT  # the extra field's own 4-byte header comes first
    info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    archive.writestr(info, data)


class _Pickle:
    """Protocol-2 pickle opcodes, written directly (nothing here imports torch)."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")  # PROTO 2

    def op(self, code: bytes) -> None:
        self.out += code

    def glob(self, module: str, name: str) -> None:
        self.out += b"c" + f"{module}\n{name}\n".encode("ascii")  # GLOBAL

    def text(self, value: str) -> None:
        data = value.encode("utf-8")
        self.out += b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE

    def int(self, value: int) -> None:
        if 0 <= value < 256:
            self.out += b"K" + struct.pack("<B", value)  # BININT1
        elif 0 <= value < 65536:
            self.out += b"M" + struct.pack("<H", value)  # BININT2
        elif -2**31 <= value < 2**31:
            self.out += b"J" + struct.pack("<i", value)  # BININT
        else:
            data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + struct.pack("<B", len(data)) + data  # LONG1

    def ints(self, values: tuple[int, ...]) -> None:
        self.op(b"(")  # MARK
        for v in values:
            self.int(v)
        self.op(b"t")  # TUPLE

    def ordered_dict(self) -> None:
        self.glob("collections", "OrderedDict")
        self.op(b")R")  # EMPTY_TUPLE, REDUCE: OrderedDict()


def _state_dict_pickle(tensors: dict[str, np.ndarray], keys: dict[str, str]) -> bytes:
    """data.pkl: OrderedDict{name: _rebuild_tensor_v2(storage, 0, size, contiguous stride, False, OrderedDict())}."""
    p = _Pickle()
    p.ordered_dict()
    p.op(b"(")  # MARK for SETITEMS
    for name, array in tensors.items():
        shape = tuple(int(n) for n in np.shape(array))
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        p.text(name)
        p.glob("torch._utils", "_rebuild_tensor_v2")
        p.op(b"(")  # MARK: the arguments
        p.op(b"(")  # MARK: the persistent id
        p.text("storage")
        p.glob("torch", "FloatStorage")
        p.text(keys[name])
        p.text("cpu")
        p.int(math.prod(shape))
        p.op(b"tQ")  # TUPLE, BINPERSID
        p.int(0)  # storage offset
        p.ints(shape)
        p.ints(stride)
        p.op(b"\x89")  # NEWFALSE: requires_grad
        p.ordered_dict()  # backward hooks
        p.op(b"tR")  # TUPLE, REDUCE
    p.op(b"u.")  # SETITEMS, STOP
    return bytes(p.out)
