"""Training checkpoints: RUN_DIR/checkpoints/step-N/ with weights, optimizer state and loop state.

A checkpoint is written into a temporary directory and renamed into place, so a crash mid-write leaves
the previous checkpoint intact; only the newest `keep` are kept.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import safetensors.numpy

from mambactl.errors import MambactlError
from mambactl.models.config import ModelConfig
from mambactl.package.checkpoint import STATE_FILE, load_checkpoint_weights, save_checkpoint_weights

OPTIMIZER_FILE = "optimizer.safetensors"


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """step-N directories, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def save_checkpoint(run_dir: Path, step: int, config: ModelConfig, weights: dict, optimizer: dict,
                    state: dict, keep: int) -> Path:
    root = run_dir / "checkpoints"
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_checkpoint_weights(tmp, config, weights)
    (tmp / OPTIMIZER_FILE).write_bytes(safetensors.numpy.save({k: np.ascontiguousarray(v) for k, v in optimizer.items()}))
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in checkpoint_dirs(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    return final


def load_checkpoint(path: Path) -> tuple[ModelConfig, dict, dict, dict]:
    """-> (model config, weights, optimizer arrays, loop state)."""
    config, weights = load_checkpoint_weights(path)
    try:
        optimizer = safetensors.numpy.load_file(str(path / OPTIMIZER_FILE))
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise MambactlError(f"{path}: incomplete checkpoint ({str(exc).splitlines()[0]})") from None
    return config, weights, optimizer, state
