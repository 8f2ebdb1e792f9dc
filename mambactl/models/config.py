"""Architecture description of a Mamba-family LM: dims and the per-layer schedule.

The config is plain data (dataclasses of ints, floats and strings) so it round-trips through TOML,
the `.evermind` manifest and HF-style config.json without a custom encoder.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from mambactl.errors import MambactlError

LAYER_TYPES = ("mamba1", "mamba2", "mamba3", "attention")
MAX_ATTENTION_HEAD_DIM = 128  # the GPU attention kernels' limit (mambactl/ops/attention.py)

# `Mamba2Config.dt_limit` upper bound meaning "no limit" (mamba_ssm's float("inf")): a finite float, so the
# config round-trips through TOML (which mambactl reads as finite numbers only) and JSON (which has no inf).
# Clamping to it is a no-op in float32 and float64 alike. `inf` or None given for the bound is read as this.
NO_DT_LIMIT = 1e30


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
class Mamba2Config:
    """Settings of a Mamba-2 (SSD) mixer; defaults are mamba_ssm's `Mamba2` defaults (rmsnorm=True,
    norm_before_gate=False, D_has_hdim=False, d_ssm=d_inner, i.e. no gated-MLP part)."""

    d_state: int = 128
    d_conv: int = 4
    expand: int = 2
    headdim: int = 64  # nheads = expand * d_model / headdim
    ngroups: int = 1  # B / C groups, each shared by nheads / ngroups heads; also the gated-norm groups
    # mamba_ssm's / HF's chunk_size, kept so the model imports and exports as it came: the SSD's result does not
    # depend on the chunk (up to float rounding), so mambactl's kernels pick their own (ops/ssd.py kernel_chunk)
    chunk_size: int = 256
    A_init_range: list[float] = field(default_factory=lambda: [1.0, 16.0])  # A = -U(lo, hi) at init
    dt_min: float = 1e-3
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_limit: list[float] = field(default_factory=lambda: [0.0, NO_DT_LIMIT])  # clamp of softplus(dt + dt_bias)
    conv_bias: bool = True
    bias: bool = False  # in_proj / out_proj bias
    norm_before_gate: bool = False  # rmsnorm(y · SiLU(z)) · w; only False (mamba_ssm's default, HF's only form)

    def __post_init__(self) -> None:
        # Accept tuples (mamba_ssm / HF spelling) and an unbounded upper limit given as inf or None (JSON null).
        if isinstance(self.A_init_range, tuple):
            self.A_init_range = list(self.A_init_range)
        if isinstance(self.dt_limit, tuple):
            self.dt_limit = list(self.dt_limit)
        if isinstance(self.dt_limit, list) and len(self.dt_limit) == 2:
            hi = self.dt_limit[1]
            if hi is None or (isinstance(hi, float) and math.isinf(hi) and hi > 0):
                self.dt_limit = [self.dt_limit[0], NO_DT_LIMIT]

    @property
    def has_dt_limit(self) -> bool:
        """False for the default (0, no limit): clamping then changes nothing (softplus is >= 0)."""
        return self.dt_limit[0] > 0 or self.dt_limit[1] < NO_DT_LIMIT

    @property
    def dt_limit_inf(self) -> tuple[float, float]:
        """dt_limit as mamba_ssm / HF spell it: (lo, float("inf")) when there is no upper limit."""
        lo, hi = self.dt_limit
        return float(lo), (math.inf if hi >= NO_DT_LIMIT else float(hi))


@dataclass
class Mamba3Config:
    """Settings of a Mamba-3 mixer; defaults are mamba_ssm's `Mamba3` defaults (SISO, no out-norm)."""

    d_state: int = 128
    expand: int = 2
    headdim: int = 64  # nheads = expand * d_model / headdim
    ngroups: int = 1  # B / C groups, each shared by nheads / ngroups heads
    rope_fraction: float = 0.5  # share of the state dims the data-dependent rotation turns: 0.5 or 1.0
    dt_min: float = 1e-3
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    A_floor: float = 1e-4  # A = -max(heavy_tail(dd_A), A_floor)
    is_outproj_norm: bool = False  # headwise RMSNorm of y before the gate (norm.weight)
    is_mimo: bool = False
    mimo_rank: int = 4  # R, used only with is_mimo
    # mamba_ssm's chunk_size (it recommends 64 for SISO, 64 / mimo_rank for MIMO), kept for import and export; the
    # scan's result does not depend on it, and mambactl's kernels pick their own (ops/mamba3_scan.py)
    chunk_size: int = 64


@dataclass
class AttentionConfig:
    """Settings of a causal multi-head attention mixer (for hybrids): fused QKV projection, softmax attention
    per head (head dim d_model / n_heads), out_proj."""

    n_heads: int = 8
    rope: bool = True  # rotary position embedding on q and k (HF Llama's rotate_half layout)
    rope_base: float = 10000.0
    bias: bool = False  # qkv_proj / out_proj bias


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
    mamba2: Mamba2Config = field(default_factory=Mamba2Config)
    mamba3: Mamba3Config = field(default_factory=Mamba3Config)
    attention: AttentionConfig = field(default_factory=AttentionConfig)

    def __post_init__(self) -> None:
        if isinstance(self.mamba1, dict):
            self.mamba1 = _from_dict(Mamba1Config, self.mamba1, "model.mamba1")
        if isinstance(self.mamba2, dict):
            self.mamba2 = _from_dict(Mamba2Config, self.mamba2, "model.mamba2")
        if isinstance(self.mamba3, dict):
            self.mamba3 = _from_dict(Mamba3Config, self.mamba3, "model.mamba3")
        if isinstance(self.attention, dict):
            self.attention = _from_dict(AttentionConfig, self.attention, "model.attention")
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

    # Mamba-2 dims (d_inner above is Mamba-1's) ---------------------------------------
    @property
    def mamba2_d_inner(self) -> int:
        return self.mamba2.expand * self.d_model

    @property
    def mamba2_nheads(self) -> int:
        return self.mamba2_d_inner // self.mamba2.headdim

    @property
    def mamba2_conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C (d_inner + 2 · ngroups · d_state)."""
        return self.mamba2_d_inner + 2 * self.mamba2.ngroups * self.mamba2.d_state

    @property
    def mamba2_in_proj_dim(self) -> int:
        """Rows of in_proj: z, x, B, C, dt (2 · d_inner + 2 · ngroups · d_state + nheads)."""
        return self.mamba2_d_inner + self.mamba2_conv_dim + self.mamba2_nheads

    # Mamba-3 dims -------------------------------------------------------------------------
    @property
    def mamba3_d_inner(self) -> int:
        return self.mamba3.expand * self.d_model

    @property
    def mamba3_nheads(self) -> int:
        return self.mamba3_d_inner // self.mamba3.headdim

    @property
    def mamba3_rank(self) -> int:
        """R: mimo_rank with is_mimo, else 1 (SISO)."""
        return self.mamba3.mimo_rank if self.mamba3.is_mimo else 1

    @property
    def mamba3_num_rope_angles(self) -> int:
        """S: floor(d_state · rope_fraction), made even, halved (one angle per rotated pair)."""
        return int(self.mamba3.d_state * self.mamba3.rope_fraction) // 2

    @property
    def mamba3_in_proj_dim(self) -> int:
        """Rows of in_proj: z, x, B, C, dd_dt, dd_A, trap, angle (2 · d_inner + 2 · R · G · N + 3 · H + S)."""
        m = self.mamba3
        return (2 * self.mamba3_d_inner + 2 * self.mamba3_rank * m.ngroups * m.d_state + 3 * self.mamba3_nheads
                + self.mamba3_num_rope_angles)

    @property
    def attention_head_dim(self) -> int:
        return self.d_model // self.attention.n_heads

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
        m2 = self.mamba2
        for key in ("d_state", "expand", "headdim", "ngroups", "chunk_size"):
            v = getattr(m2, key)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"mamba2.{key}",
                 "must be a positive integer")
        need(1 <= m2.d_conv <= 64, "mamba2.d_conv", "must be in [1, 64]")
        need(0 < m2.dt_min <= m2.dt_max, "mamba2.dt_min", "must satisfy 0 < dt_min <= dt_max")
        need(m2.dt_init_floor >= 0, "mamba2.dt_init_floor", "must be >= 0")
        need(_pair(m2.A_init_range) and 0 < m2.A_init_range[0] <= m2.A_init_range[1], "mamba2.A_init_range",
             "must be two numbers [lo, hi] with 0 < lo <= hi")
        need(_pair(m2.dt_limit) and 0 <= m2.dt_limit[0] < m2.dt_limit[1], "mamba2.dt_limit",
             f"must be two numbers [lo, hi] with 0 <= lo < hi ({NO_DT_LIMIT:g} = no upper limit)")
        need(m2.norm_before_gate is False, "mamba2.norm_before_gate",
             "must be false (the gate goes before the norm, as in mamba_ssm's default and HF)")
        if "mamba2" in self.layers:
            need(self.mamba2_d_inner % m2.headdim == 0, "mamba2.headdim",
                 f"must divide d_inner = expand * d_model = {self.mamba2_d_inner}")
            need(self.mamba2_nheads % m2.ngroups == 0, "mamba2.ngroups",
                 f"must divide the number of heads ({self.mamba2_nheads})")
        m3 = self.mamba3
        for key in ("d_state", "expand", "headdim", "ngroups", "mimo_rank", "chunk_size"):
            v = getattr(m3, key)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"mamba3.{key}",
                 "must be a positive integer")
        need(m3.rope_fraction in (0.5, 1.0), "mamba3.rope_fraction", "must be 0.5 or 1.0 (as mamba_ssm)")
        need(0 < m3.dt_min <= m3.dt_max, "mamba3.dt_min", "must satisfy 0 < dt_min <= dt_max")
        need(m3.dt_init_floor >= 0, "mamba3.dt_init_floor", "must be >= 0")
        need(m3.A_floor > 0, "mamba3.A_floor", "must be > 0")
        for key in ("is_outproj_norm", "is_mimo"):
            need(isinstance(getattr(m3, key), bool), f"mamba3.{key}", "must be true or false")
        if "mamba3" in self.layers:
            need(self.mamba3_d_inner % m3.headdim == 0, "mamba3.headdim",
                 f"must divide d_inner = expand * d_model = {self.mamba3_d_inner}")
            need(self.mamba3_nheads % m3.ngroups == 0, "mamba3.ngroups",
                 f"must divide the number of heads ({self.mamba3_nheads})")
            need(self.mamba3_num_rope_angles >= 1, "mamba3.d_state",
                 "too small: d_state * rope_fraction must be at least 2 (one rotated pair)")
        a = self.attention
        need(isinstance(a.n_heads, int) and not isinstance(a.n_heads, bool) and a.n_heads >= 1, "attention.n_heads",
             "must be a positive integer")
        need(a.rope_base > 1, "attention.rope_base", "must be > 1")
        if "attention" in self.layers:
            need(self.d_model % a.n_heads == 0, "attention.n_heads", f"must divide d_model = {self.d_model}")
            need(self.attention_head_dim <= MAX_ATTENTION_HEAD_DIM, "attention.n_heads",
                 f"must give a head dim d_model / n_heads of at most {MAX_ATTENTION_HEAD_DIM}")
            need(not a.rope or self.attention_head_dim % 2 == 0, "attention.rope",
                 "needs an even head dim d_model / n_heads")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "model") -> "ModelConfig":
        return _from_dict(cls, data, where)


def _pair(v) -> bool:
    return (isinstance(v, (list, tuple)) and len(v) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v))


def _from_dict(cls, data: dict, where: str):
    """Build a dataclass from a dict, naming any unknown key (typos must not pass silently)."""
    if not isinstance(data, dict):
        raise MambactlError(f"{where}: expected a table, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    for key in data:
        if key not in names:
            raise MambactlError(f"{where}.{key}: unknown key; allowed: {', '.join(sorted(names))}")
    return cls(**data)
