"""Architecture description of a Mamba-family LM: dims and the per-layer schedule.

The config is plain data (dataclasses of ints, floats and strings) so it round-trips through TOML,
the `.evermind` manifest and HF-style config.json without a custom encoder.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from mambactl.errors import MambactlError

LAYER_TYPES = ("mamba1",)


@dataclass
class Mamba1Config:
    """Settings of a Mamba-1 (S6) mixer; defaults are mamba_ssm's `Mamba` defaults."""

    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int | str = "auto"  # "auto" -> ceil(d_model / 16)
    dt_min: float = 1e-3
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    conv_bias: bool = True
    bias: bool = False  # in_proj / out_proj bias


@dataclass
class ModelConfig:
    """A language model: embedding -> n_layer (pre-RMSNorm mixer + residual) -> norm_f -> tied head."""

    vocab_size: int = 256
    d_model: int = 64
    n_layer: int = 2
    layers: list[str] = field(default_factory=list)  # per-layer type; empty -> all "mamba1"
    pad_vocab_size_multiple: int = 8
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    mamba1: Mamba1Config = field(default_factory=Mamba1Config)

    def __post_init__(self) -> None:
        if isinstance(self.mamba1, dict):
            self.mamba1 = _from_dict(Mamba1Config, self.mamba1, "model.mamba1")
        if not self.layers:
            self.layers = ["mamba1"] * self.n_layer
        self.validate()

    # derived dims -----------------------------------------------------------------
    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return self.vocab_size if m <= 1 else -(-self.vocab_size // m) * m

    @property
    def d_inner(self) -> int:
        return self.mamba1.expand * self.d_model

    @property
    def dt_rank(self) -> int:
        r = self.mamba1.dt_rank
        return math.ceil(self.d_model / 16) if r == "auto" else int(r)

    def validate(self) -> None:
        def need(ok: bool, key: str, allowed: str) -> None:
            if not ok:
                raise MambactlError(f"model.{key}: {allowed}")

        need(isinstance(self.vocab_size, int) and self.vocab_size >= 2, "vocab_size", "must be an integer >= 2")
        need(isinstance(self.d_model, int) and self.d_model >= 1, "d_model", "must be a positive integer")
        need(isinstance(self.n_layer, int) and self.n_layer >= 1, "n_layer", "must be a positive integer")
        need(len(self.layers) == self.n_layer, "layers", f"has {len(self.layers)} entries but n_layer is {self.n_layer}")
        for t in self.layers:
            need(t in LAYER_TYPES, "layers", f"unknown layer type {t!r}; allowed: {', '.join(LAYER_TYPES)}")
        need(self.pad_vocab_size_multiple >= 1, "pad_vocab_size_multiple", "must be >= 1")
        need(0 < self.norm_eps < 1, "norm_eps", "must be in (0, 1)")
        m = self.mamba1
        need(m.d_state >= 1, "mamba1.d_state", "must be >= 1")
        need(1 <= m.d_conv <= 64, "mamba1.d_conv", "must be in [1, 64]")
        need(m.expand >= 1, "mamba1.expand", "must be >= 1")
        need(m.dt_rank == "auto" or (isinstance(m.dt_rank, int) and m.dt_rank >= 1), "mamba1.dt_rank",
             'must be "auto" or a positive integer')
        need(0 < m.dt_min <= m.dt_max, "mamba1.dt_min", "must satisfy 0 < dt_min <= dt_max")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "model") -> "ModelConfig":
        return _from_dict(cls, data, where)


def _from_dict(cls, data: dict, where: str):
    """Build a dataclass from a dict, naming any unknown key (typos must not pass silently)."""
    if not isinstance(data, dict):
        raise MambactlError(f"{where}: expected a table, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    for key in data:
        if key not in names:
            raise MambactlError(f"{where}.{key}: unknown key; allowed: {', '.join(sorted(names))}")
    return cls(**data)
