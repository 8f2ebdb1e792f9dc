"""Checkpoint directories and the file helpers the package modules share.

A checkpoint directory (`RUN_DIR/` or `RUN_DIR/checkpoints/step-N/`) holds:

- `model.safetensors`: float32 weights keyed by parameter name (`mambactl.models.params.parameter_specs`);
- `model.json`: `ModelConfig.to_dict()` as JSON;
- optionally `tokenizer.json`, and `train_state.json` whose keys `step`, `tokens_seen` and `losses`
  ({name: number}) become a package's provenance; `config.toml` (the training config) in the directory or,
  for `checkpoints/step-N/`, in the run directory.

Each file is written atomically (temp file + rename), so a crash never leaves a half-written file under its name.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import safetensors.numpy

from mambactl.errors import MambactlError
from mambactl.models.config import ModelConfig
from mambactl.models.params import parameter_specs

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "model.json"
TOKENIZER_FILE = "tokenizer.json"
STATE_FILE = "train_state.json"
TRAIN_CONFIG_FILE = "config.toml"


# shared helpers -------------------------------------------------------------------------------------------------
def atomic_write(path: Path, chunks: Iterable[bytes | memoryview]) -> None:
    """Write `chunks` to `path` through a temp file in the same directory, fsync, then rename over `path`.

    On any failure (including one raised while producing `chunks`) the temp file is removed and an existing
    `path` is left untouched.
    """
    if path.is_dir():
        raise MambactlError(f"{path}: is a directory")
    if not path.parent.is_dir():
        raise MambactlError(f"{path}: directory {path.parent} does not exist")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise MambactlError(f"{path}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def require_file(path: Path) -> None:
    """Raise a one-line error unless `path` is an existing regular file."""
    if path.is_dir():
        raise MambactlError(f"{path}: is a directory, expected a file")
    if not path.is_file():
        raise MambactlError(f"{path}: no such file")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (or its type name), for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def config_from_dict(data: object, where: str) -> ModelConfig:
    """`ModelConfig.from_dict` with every problem, wrongly typed values included, as one line naming `where`."""
    try:
        return ModelConfig.from_dict(data)
    except MambactlError as exc:
        raise MambactlError(f"{where}: {exc}") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise MambactlError(f"{where}: invalid model config ({first_line(exc)})") from None


def check_parameters(config: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Check that `shapes` ({name: shape}) holds exactly the parameters `config` requires, with their shapes."""
    specs = parameter_specs(config)
    for s in specs:
        if s.name not in shapes:
            raise MambactlError(f"missing parameter {s.name} (shape {list(s.shape)})")
        if tuple(shapes[s.name]) != s.shape:
            raise MambactlError(f"parameter {s.name} has shape {list(shapes[s.name])}; "
                                f"the config needs {list(s.shape)}")
    unexpected = sorted(set(shapes) - {s.name for s in specs})
    if unexpected:
        raise MambactlError(f"unexpected tensor {unexpected[0]} (not a parameter of this model config)")


# checkpoints ----------------------------------------------------------------------------------------------------
def save_checkpoint_weights(directory: str | Path, config: ModelConfig, weights: Mapping[str, np.ndarray]) -> None:
    """Write `model.safetensors` (float32) and `model.json` into `directory` (created if missing).

    `weights` maps every parameter name of `config` to an array of its shape (see `parameter_specs`).
    """
    directory = Path(directory)
    check_parameters(config, {k: np.shape(v) for k, v in weights.items()})
    blob = safetensors.numpy.save({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()})
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / WEIGHTS_FILE, [blob])
    atomic_write(directory / CONFIG_FILE, [json.dumps(config.to_dict(), indent=2).encode("utf-8") + b"\n"])


def load_checkpoint_weights(path: str | Path, config_path: str | Path | None = None
                            ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a checkpoint directory, or a bare .safetensors file with its model.json, as (config, float32 weights).

    `config_path` overrides the `model.json` looked up in the directory or beside the file.
    """
    path = Path(path)
    weights_path = path / WEIGHTS_FILE if path.is_dir() else path
    config_path = Path(config_path) if config_path is not None else weights_path.with_name(CONFIG_FILE)
    require_file(weights_path)
    if not config_path.is_file():
        raise MambactlError(f"{config_path}: no such file (the model config for {weights_path})")
    try:
        config_data = json.loads(config_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise MambactlError(f"{config_path}: not JSON ({first_line(exc)})") from None
    config = config_from_dict(config_data, str(config_path))
    try:
        tensors = safetensors.numpy.load_file(str(weights_path))
    except Exception as exc:  # SafetensorError and friends: a corrupt or foreign file
        raise MambactlError(f"{weights_path}: not a readable safetensors file ({first_line(exc)})") from None
    try:
        check_parameters(config, {k: v.shape for k, v in tensors.items()})
    except MambactlError as exc:
        raise MambactlError(f"{weights_path}: {exc}") from None
    for name, value in tensors.items():
        if not np.issubdtype(value.dtype, np.floating):
            raise MambactlError(f"{weights_path}: tensor {name} has dtype {value.dtype}, expected floating point")
    return config, {k: v.astype(np.float32, copy=False) for k, v in tensors.items()}


def find_beside(checkpoint: Path, name: str) -> Path | None:
    """`name` in a checkpoint directory (or beside a weights file), else in the run directory of `step-N/`."""
    directory = checkpoint if checkpoint.is_dir() else checkpoint.parent
    candidates = [directory / name]
    if directory.parent.name == "checkpoints":
        candidates.append(directory.parent.parent / name)
    return next((c for c in candidates if c.is_file()), None)


def checkpoint_provenance(checkpoint: Path) -> dict:
    """Provenance for a package from a checkpoint's `train_state.json` and `config.toml`, where present."""
    provenance: dict = {}
    config_toml = find_beside(checkpoint, TRAIN_CONFIG_FILE)
    if config_toml is not None:
        try:
            provenance["training_config"] = config_toml.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise MambactlError(f"{config_toml}: not UTF-8 text") from None
    state_path = (checkpoint if checkpoint.is_dir() else checkpoint.parent) / STATE_FILE
    if state_path.is_file():
        try:
            state = json.loads(state_path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise MambactlError(f"{state_path}: not JSON ({first_line(exc)})") from None
        if not isinstance(state, dict):
            raise MambactlError(f"{state_path}: expected a JSON object")
        for key, target in (("step", "steps"), ("tokens_seen", "tokens_seen"), ("losses", "final_losses")):
            if state.get(key) is not None:
                provenance[target] = state[key]
    return provenance
