"""The `.evermind` package, format version 2: weights, tokenizer, model config and manifest in one file.

Specification: docs/evermind-format.md. Layout (all integers little-endian):

    offset 0      u32 magic 0x45564D31, u32 format version (2), u32 manifest length M
    offset 12     M bytes of manifest, UTF-8 JSON, schema "evermind.model/2"
    offset 12+M   32 bytes: SHA-256 of bytes [0, 12+M) (header + manifest)
    then          the sections in section-table order (name, format, offset, length, sha256), each at the first
                  64-byte boundary after the previous one, zero bytes between; the file ends with the last section.

The reader checks every length against the file size before using it, checks the manifest digest, the section
table, the weights' safetensors header against the config's parameter table, and (with `verify`) the SHA-256 of
every section. Version-1 packages of the old engine are read as far as their manifest.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
from tokenizers import Tokenizer

from mambactl import __version__
from mambactl.errors import MambactlError
from mambactl.models.config import ModelConfig
from mambactl.models.params import parameter_specs
from mambactl.package.checkpoint import atomic_write, check_parameters, config_from_dict, first_line, require_file
from mambactl.package.tokenizer import parse_tokenizer_json, tokenizer_summary, vocab_size

MAGIC = 0x45564D31
VERSION = 2
SCHEMA = "evermind.model/2"
MODEL_TYPE = "mamba-lm"
ALIGN = 64
WEIGHTS, TOKENIZER = "weights", "tokenizer"
_HEAD = struct.Struct("<III")
_DIGEST_SIZE = 32
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}  # dtypes a weights section may hold
WRITE_DTYPES = {"F32": np.float32, "F16": np.float16}  # dtypes `write_package` writes
_REQUIRED_KEYS = ("schema", "name", "version", "model_type", "config", "param_count", "dtype", "tokenizer",
                  "sections", "card", "provenance", "created_at")
_SECTION_KEYS = ("name", "format", "offset", "length", "sha256")
_SECTION_NAME = re.compile(r"[a-z][a-z0-9_.-]*")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


# manifest field tables: key -> (check, what is allowed, default) -----------------------------------------------
def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_opt_str(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _is_count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _is_opt_count(v: Any) -> bool:
    return v is None or _is_count(v)


def _is_losses(v: Any) -> bool:
    return v is None or isinstance(v, dict) and all(
        type(x) in (int, float) and math.isfinite(x) for x in v.values())


_Fields = Mapping[str, tuple[Callable[[Any], bool], str, Any]]
CARD_FIELDS: _Fields = {
    "description": (_is_str, "must be a string", ""),
    "license": (_is_opt_str, "must be a string or null", None),
    "author": (_is_opt_str, "must be a string or null", None),
    "tags": (lambda v: isinstance(v, list) and all(map(_is_str, v)), "must be a list of strings", []),
    "training_summary": (_is_opt_str, "must be a string or null", None),
}
PROVENANCE_FIELDS: _Fields = {
    "mambactl_version": (_is_str, "must be a string", __version__),
    "training_config": (_is_opt_str, "must be the training config as TOML text, or null", None),
    "steps": (_is_opt_count, "must be a non-negative integer or null", None),
    "tokens_seen": (_is_opt_count, "must be a non-negative integer or null", None),
    "final_losses": (_is_losses, "must be an object of finite numbers ({name: loss}) or null", None),
}


def _table(data: Any, where: str, fields: _Fields) -> dict:
    """Check an object against a field table, filling defaults; unknown keys are errors (typos must not pass)."""
    if not isinstance(data, dict):
        raise MambactlError(f"{where}: expected an object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise MambactlError(f"{where}.{unknown[0]}: unknown key; allowed: {', '.join(fields)}")
    out = {}
    for key, (ok, allowed, default) in fields.items():
        out[key] = data.get(key, default)
        if not ok(out[key]):
            raise MambactlError(f"{where}.{key}: {allowed}")
    return out


# data types -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Section:
    """One entry of the manifest's section table: bytes [offset, offset + length) of the file."""

    name: str
    format: str
    offset: int
    length: int
    sha256: str


@dataclass(frozen=True)
class _Tensor:
    dtype: str  # "F32" | "F16" | "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute file offset of its data


@dataclass(eq=False)
class Package:
    """A loaded package. `weights` maps the tensors from the file (memory-mapped) on first access."""

    path: Path
    manifest: dict
    config: ModelConfig
    tokenizer: Tokenizer
    sections: dict[str, Section]
    _map: mmap.mmap = field(repr=False)
    _tensors: dict[str, _Tensor] = field(repr=False)  # in parameter_specs order

    @cached_property
    def weights(self) -> dict[str, np.ndarray]:
        """{parameter name: float32 array of its spec shape}; F32 tensors are read-only views of the file."""
        return {name: _as_float32(self._map, t) for name, t in self._tensors.items()}

    def section(self, name: str) -> memoryview:
        """The raw bytes of a section (e.g. "optimizer", "card"), without copying."""
        if name not in self.sections:
            raise MambactlError(f"{self.path}: no section {name!r} (has: {', '.join(self.sections)})")
        s = self.sections[name]
        return memoryview(self._map)[s.offset:s.offset + s.length]

    def parameters(self) -> list[dict]:
        """[{"name", "shape", "count", "dtype"}] for every parameter, in parameter_specs order."""
        return [{"name": n, "shape": list(t.shape), "count": math.prod(t.shape), "dtype": t.dtype}
                for n, t in self._tensors.items()]


def _as_float32(buf: mmap.mmap, t: _Tensor) -> np.ndarray:
    count = math.prod(t.shape)
    if t.dtype == "BF16":  # bfloat16 is the top half of a float32
        raw = np.frombuffer(buf, dtype="<u2", count=count, offset=t.offset)
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(t.shape)
    raw = np.frombuffer(buf, dtype="<f4" if t.dtype == "F32" else "<f2", count=count, offset=t.offset)
    return raw.astype(np.float32, copy=False).reshape(t.shape)


# writing --------------------------------------------------------------------------------------------------------
def write_package(
    path: str | Path,
    config: ModelConfig,
    weights: Mapping[str, np.ndarray],
    tokenizer: Tokenizer,
    *,
    name: str,
    version: str,
    card: Mapping[str, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
    extra_sections: Mapping[str, tuple[str, bytes]] | None = None,
    dtype: str = "F32",
) -> dict:
    """Write a package atomically and deterministically; return its manifest.

    weights: {parameter name: array of the shape `parameter_specs(config)` gives}, stored as `dtype` (F32/F16).
    card: keys of CARD_FIELDS; provenance: keys of PROVENANCE_FIELDS (mambactl_version defaults to this one).
    extra_sections: {name: (format, bytes)}, e.g. {"card": ("markdown", b"# ...")}, stored after the tokenizer.
    The creation time is SOURCE_DATE_EPOCH when set, so identical inputs give byte-identical files.
    Everything is checked before the output is touched; on failure an existing file at `path` is left as it was.
    """
    path = Path(path)
    for key, value in (("name", name), ("version", version)):
        if not isinstance(value, str) or not value:
            raise MambactlError(f"package {key} must be a non-empty string")
    if dtype not in WRITE_DTYPES:
        raise MambactlError(f"package dtype {dtype!r} is not one of {', '.join(WRITE_DTYPES)}")
    arrays = {k: np.asarray(v) for k, v in weights.items()}
    check_parameters(config, {k: v.shape for k, v in arrays.items()})
    for k, v in arrays.items():
        if not np.issubdtype(v.dtype, np.floating):
            raise MambactlError(f"parameter {k} has dtype {v.dtype}, expected floating point")
    tokenizer_json = tokenizer.to_str()
    try:
        parse_tokenizer_json(tokenizer_json)  # what a reader will accept
    except MambactlError as exc:
        raise MambactlError(f"tokenizer: {exc}") from None
    summary = tokenizer_summary(tokenizer)
    _check_vocab_fits(summary["vocab_size"], config)
    card = _table(dict(card or {}), "card", CARD_FIELDS)
    provenance = _table({"mambactl_version": __version__, **(provenance or {})}, "provenance", PROVENANCE_FIELDS)
    extras = _check_extra_sections(extra_sections or {})
    created_at = _created_at()
    payloads = [(WEIGHTS, "safetensors",
                 safetensors.numpy.save({k: np.ascontiguousarray(v, WRITE_DTYPES[dtype]) for k, v in arrays.items()})),
                (TOKENIZER, "tokenizer.json", tokenizer_json.encode("utf-8")),
                *extras]
    manifest = {
        "schema": SCHEMA,
        "name": name,
        "version": version,
        "model_type": MODEL_TYPE,
        "config": config.to_dict(),
        "param_count": sum(int(v.size) for v in arrays.values()),
        "dtype": dtype,
        "tokenizer": summary,
        "sections": [],  # filled by _place_sections
        "card": card,
        "provenance": provenance,
        "created_at": created_at,
    }
    head = _place_sections(manifest, payloads)
    atomic_write(path, _file_chunks(head, manifest["sections"], payloads))
    return manifest


def _check_extra_sections(extra: Mapping[str, tuple[str, bytes]]) -> list[tuple[str, str, bytes]]:
    out = []
    for name, (fmt, data) in extra.items():
        if name in (WEIGHTS, TOKENIZER) or not _SECTION_NAME.fullmatch(name):
            raise MambactlError(f"section name {name!r} must match [a-z][a-z0-9_.-]* and not be weights/tokenizer")
        if not isinstance(fmt, str) or not fmt:
            raise MambactlError(f"section {name!r}: format must be a non-empty string")
        out.append((name, fmt, bytes(data)))
    return out


def _created_at() -> str:
    """ISO 8601 UTC time: SOURCE_DATE_EPOCH (reproducible builds) when set, else now."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    try:
        when = datetime.now(timezone.utc) if epoch is None else datetime.fromtimestamp(int(epoch), timezone.utc)
    except (ValueError, OverflowError, OSError):
        raise MambactlError(f"SOURCE_DATE_EPOCH={epoch!r} is not a valid Unix time") from None
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _place_sections(manifest: dict, payloads: list[tuple[str, str, bytes]]) -> bytes:
    """Fill manifest["sections"] with absolute offsets; return header + manifest + digest.

    Offsets depend on the manifest's length, which depends on the offsets' digits: iterate to the fixed point
    (the data start only grows, so this ends after a step or two).
    """
    hashes = [hashlib.sha256(data).hexdigest() for _, _, data in payloads]
    data_start = 0
    while True:
        offset, sections = data_start, []
        for (name, fmt, data), digest in zip(payloads, hashes):
            sections.append({"name": name, "format": fmt, "offset": offset, "length": len(data), "sha256": digest})
            offset = _align(offset + len(data))
        manifest["sections"] = sections
        body = json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode("utf-8")
        start = _align(_HEAD.size + len(body) + _DIGEST_SIZE)
        if start == data_start:
            head = _HEAD.pack(MAGIC, VERSION, len(body)) + body
            return head + hashlib.sha256(head).digest()
        data_start = start


def _file_chunks(head: bytes, sections: list[dict], payloads: list[tuple[str, str, bytes]]) -> Iterator[bytes]:
    pos = len(head)
    yield head
    for s, (_, _, data) in zip(sections, payloads):
        yield bytes(s["offset"] - pos)
        yield data
        pos = s["offset"] + len(data)


def _check_vocab_fits(tokens: int, config: ModelConfig) -> None:
    if tokens != config.vocab_size:
        raise MambactlError(f"the tokenizer has {tokens} tokens but the model's vocab_size is {config.vocab_size}; "
                            "use the tokenizer the model was trained with")


# reading --------------------------------------------------------------------------------------------------------
@contextmanager
def _about(path: Path) -> Iterator[None]:
    """Prefix any MambactlError raised inside with the file it is about."""
    try:
        yield
    except MambactlError as exc:
        raise MambactlError(f"{path}: {exc}") from None


def _map(path: Path) -> mmap.mmap:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEAD.size:
                raise MambactlError(f"file is {size} bytes, too short for an .evermind header")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise MambactlError(f"cannot read ({exc.strerror or exc})") from None


def _parse_head(buf: mmap.mmap) -> tuple[int, dict, int]:
    """Check magic, version, manifest length and digest; return (version, parsed manifest, end of the head)."""
    size = len(buf)
    magic, version, length = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise MambactlError(f"not an .evermind package (magic 0x{magic:08X}, expected 0x{MAGIC:08X})")
    if version not in (1, VERSION):
        raise MambactlError(f"format version {version} is not supported (mambactl reads versions 1 and 2)")
    end = _HEAD.size + length
    digest_size = _DIGEST_SIZE if version == VERSION else 0
    if end + digest_size > size:
        raise MambactlError(f"manifest length {length} runs past the end of the file ({size} bytes)")
    if version == VERSION and hashlib.sha256(buf[:end]).digest() != buf[end:end + _DIGEST_SIZE]:
        raise MambactlError("manifest is corrupt: its SHA-256 does not match")
    try:
        manifest = json.loads(buf[_HEAD.size:end].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise MambactlError(f"manifest is not valid JSON ({first_line(exc)})") from None
    if not isinstance(manifest, dict):
        raise MambactlError(f"manifest is a JSON {type(manifest).__name__}, expected an object")
    return version, manifest, end + digest_size


def _check_manifest(m: dict, buf: mmap.mmap, head_end: int) -> dict[str, Section]:
    """Validate a v2 manifest's keys and types, and its section table against the file."""
    for key in _REQUIRED_KEYS:
        if key not in m:
            raise MambactlError(f"manifest is missing key {key!r}")
    if m["schema"] != SCHEMA:
        raise MambactlError(f"manifest schema {m['schema']!r} is not {SCHEMA!r}")
    if m["model_type"] != MODEL_TYPE:
        raise MambactlError(f"model type {m['model_type']!r} is not one mambactl loads ({MODEL_TYPE!r})")
    for key, ok, allowed in (("name", _is_str, "a string"), ("version", _is_str, "a string"),
                             ("created_at", _is_str, "a string"),
                             ("config", lambda v: isinstance(v, dict), "an object"),
                             ("param_count", _is_count, "a non-negative integer"),
                             ("dtype", lambda v: _is_str(v) and v in _ITEMSIZE, f"one of {', '.join(_ITEMSIZE)}")):
        if not ok(m[key]):
            raise MambactlError(f"manifest {key} must be {allowed}")
    tok = m["tokenizer"]
    if not (isinstance(tok, dict) and _is_count(tok.get("vocab_size")) and isinstance(tok.get("specials"), dict)
            and all(map(_is_count, tok["specials"].values()))):
        raise MambactlError("manifest tokenizer must be an object with vocab_size and specials {token: id}")
    _table(m["card"], "manifest card", CARD_FIELDS)
    _table(m["provenance"], "manifest provenance", PROVENANCE_FIELDS)
    return _check_sections(m["sections"], buf, head_end)


def _check_sections(entries: Any, buf: mmap.mmap, head_end: int) -> dict[str, Section]:
    """Sections: well-formed entries inside the file, laid out in table order, each at the first 64-byte boundary
    after the previous one (or the head), with zero padding between and nothing after the last."""
    size = len(buf)
    if not isinstance(entries, list):
        raise MambactlError("manifest sections must be a list")
    sections: dict[str, Section] = {}
    for i, e in enumerate(entries):
        if not (isinstance(e, dict) and set(_SECTION_KEYS) <= set(e) and _is_str(e["name"]) and _is_str(e["format"])
                and _is_count(e["offset"]) and _is_count(e["length"])
                and _is_str(e["sha256"]) and _SHA256_HEX.fullmatch(e["sha256"])):
            raise MambactlError(f"manifest sections[{i}] must have name, format, offset, length (integers >= 0) "
                                "and sha256 (64 hex digits)")
        s = Section(*(e[k] for k in _SECTION_KEYS))
        if s.name in sections:
            raise MambactlError(f"section {s.name!r} appears twice")
        if s.offset + s.length > size:
            raise MambactlError(f"section {s.name!r} (offset {s.offset}, length {s.length}) runs past the end "
                                f"of the file ({size} bytes): truncated or corrupt")
        sections[s.name] = s
    for name, fmt in ((WEIGHTS, "safetensors"), (TOKENIZER, "tokenizer.json")):
        if name not in sections or sections[name].format != fmt:
            raise MambactlError(f"package has no {name!r} section of format {fmt!r}")
    end = head_end
    for s in sections.values():
        if s.offset != _align(end):
            raise MambactlError(f"section {s.name!r} is at offset {s.offset}, not at {_align(end)}, the first "
                                "64-byte boundary after the previous section")
        if buf[end:s.offset].count(0) != s.offset - end:
            raise MambactlError(f"the padding before section {s.name!r} is not zero bytes")
        end = s.offset + s.length
    if end != size:
        raise MambactlError(f"{size - end} unexpected bytes after the last section")
    return sections


def _verify_sections(buf: mmap.mmap, sections: dict[str, Section]) -> None:
    for s in sorted(sections.values(), key=lambda s: s.offset):
        with memoryview(buf) as whole, whole[s.offset:s.offset + s.length] as part:
            digest = hashlib.sha256(part).hexdigest()
        if digest != s.sha256:
            raise MambactlError(f"section {s.name!r} is corrupt: SHA-256 {digest[:16]}... does not match the "
                                f"manifest's {s.sha256[:16]}...")


def _read_weights_header(buf: mmap.mmap, s: Section) -> dict[str, _Tensor]:
    """Parse and validate the safetensors header of the weights section, as strictly as safetensors does."""
    if s.length < 8:
        raise MambactlError("weights section is too short for a safetensors header")
    (n,) = struct.unpack_from("<Q", buf, s.offset)
    if n > s.length - 8:
        raise MambactlError(f"weights: safetensors header length {n} runs past the section ({s.length} bytes)")
    start = s.offset + 8
    try:
        header = json.loads(buf[start:start + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise MambactlError("weights: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise MambactlError("weights: safetensors header is not a JSON object")
    data_start, data_length = start + n, s.length - 8 - n
    spans, tensors = [], {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(info, dict) and _is_str(info.get("dtype")) and info["dtype"] in _ITEMSIZE
                and isinstance(info.get("shape"), list) and all(map(_is_count, info["shape"]))
                and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
                and all(map(_is_count, info["data_offsets"]))):
            raise MambactlError(f"weights: tensor {name} needs dtype (F32, F16 or BF16), shape and data_offsets")
        begin, end = info["data_offsets"]
        expected = math.prod(info["shape"]) * _ITEMSIZE[info["dtype"]]
        if end - begin != expected:
            raise MambactlError(f"weights: tensor {name} has {end - begin} bytes; shape {info['shape']} "
                                f"{info['dtype']} needs {expected}")
        spans.append((begin, end, name))
        tensors[name] = _Tensor(info["dtype"], tuple(info["shape"]), data_start + begin)
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise MambactlError(f"weights: tensor {name} does not start where the previous one ends")
        position = end
    if position != data_length:
        raise MambactlError(f"weights: tensors cover {position} of the {data_length} data bytes")
    return tensors


def _open_checked(path: Path) -> tuple[mmap.mmap, int, dict, dict[str, Section] | None]:
    """Map a package and check its head; v2 manifests are validated. Returns (map, version, manifest, sections)."""
    require_file(path)
    with _about(path):
        buf = _map(path)
        try:
            version, manifest, head_end = _parse_head(buf)
            sections = _check_manifest(manifest, buf, head_end) if version == VERSION else None
        except BaseException:
            buf.close()
            raise
    return buf, version, manifest, sections


def _v1_refusal(manifest: dict) -> MambactlError:
    fmt = manifest.get("checkpointFormat", "unknown")
    return MambactlError(f"an evermind v1 package of the old engine ({fmt!r} checkpoint): mambactl can show its "
                         "manifest (mambactl inspect) but cannot load or verify that checkpoint format")


def read_manifest(path: str | Path) -> dict:
    """The manifest of a package (v2: validated, with its section table checked against the file; v1: as stored).

    Reads only the header and manifest.
    """
    buf, _, manifest, _ = _open_checked(Path(path))
    buf.close()
    return manifest


def load(path: str | Path, verify: bool = True) -> Package:
    """Open a v2 package: validate the manifest, the weights against the config, and the tokenizer.

    verify: also re-hash every section (reads the whole file). The weights are mapped, not read, until
    `Package.weights` is first used.
    """
    path = Path(path)
    buf, version, manifest, sections = _open_checked(path)
    with _about(path):
        try:
            if sections is None:
                raise _v1_refusal(manifest)
            if verify:
                _verify_sections(buf, sections)
            tensors = _read_weights_header(buf, sections[WEIGHTS])
            config = _config(manifest, len(tensors))
            check_parameters(config, {n: t.shape for n, t in tensors.items()})
            for n, t in tensors.items():
                if t.dtype != manifest["dtype"]:
                    raise MambactlError(f"weights: tensor {n} is {t.dtype} but the manifest says {manifest['dtype']}")
            count = sum(math.prod(t.shape) for t in tensors.values())
            if manifest["param_count"] != count:
                raise MambactlError(f"manifest param_count {manifest['param_count']} != {count} stored parameters")
            tokenizer = _read_tokenizer(buf, sections[TOKENIZER])
            _check_vocab_fits(vocab_size(tokenizer), config)
            if manifest["tokenizer"]["vocab_size"] != config.vocab_size:
                raise MambactlError(f"manifest tokenizer vocab_size {manifest['tokenizer']['vocab_size']} != "
                                    f"the model's vocab_size {config.vocab_size}")
        except BaseException:
            buf.close()
            raise
    ordered = {s.name: tensors[s.name] for s in parameter_specs(config)}
    return Package(path, manifest, config, tokenizer, sections, buf, ordered)


def _config(manifest: dict, n_tensors: int) -> ModelConfig:
    n_layer = manifest["config"].get("n_layer")
    if type(n_layer) is int and n_layer > n_tensors:  # refuse before ModelConfig builds a list of n_layer entries
        raise MambactlError(f"config has {n_layer} layers but the weights hold only {n_tensors} tensors")
    return config_from_dict(manifest["config"], "manifest config")


def _read_tokenizer(buf: mmap.mmap, s: Section) -> Tokenizer:
    try:
        return parse_tokenizer_json(buf[s.offset:s.offset + s.length].decode("utf-8"))
    except UnicodeDecodeError:
        raise MambactlError("tokenizer section is not UTF-8") from None
    except MambactlError as exc:
        raise MambactlError(f"tokenizer section: {exc}") from None


def verify(path: str | Path) -> dict:
    """Fully check a package, re-hashing every section; return its manifest or raise naming the first problem."""
    return load(path, verify=True).manifest


def describe(path: str | Path, verify: bool = False) -> dict:
    """Everything `mambactl inspect` shows, as one JSON-able object. Reads no weight data unless `verify`.

    v2: {file, size, format_version, loadable, verified, manifest, tokenizer, parameters};
    v1: {file, size, format_version, loadable: false, note, manifest}.
    """
    path = Path(path)
    buf, version, manifest, _ = _open_checked(path)
    size = len(buf)
    buf.close()
    facts = {"file": str(path), "size": size, "format_version": version, "loadable": version == VERSION}
    if version != VERSION:
        refusal = _v1_refusal(manifest)
        if verify:
            raise MambactlError(f"{path}: {refusal}")
        return {**facts, "note": str(refusal), "manifest": manifest}
    pkg = load(path, verify=verify)
    return {**facts, "verified": verify, "manifest": pkg.manifest, "tokenizer": tokenizer_summary(pkg.tokenizer),
            "parameters": pkg.parameters()}
