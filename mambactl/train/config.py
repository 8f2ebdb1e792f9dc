"""The training config: one TOML file validated into typed dataclasses before any data is read.

Sections: [model] (a ModelConfig; `vocab_size` may be "from_tokenizer"), [data], [tokenizer], [optim], [schedule],
[train], [package]; docs/configuration.md lists every key with its type, default and range. Every problem is one
MambactlError line naming the file (or the `--set` override), `section.key` and what is allowed.

Two pairs of keys are alternatives: `train.steps` / `train.tokens` and `tokenizer.path` / `tokenizer.vocab_size`.
Exactly one of each pair is "on" (> 0, or a non-empty path). Giving only one of a pair turns the other off, so
`tokens = 1_000_000` alone needs no `steps = 0`, and `--set train.steps=20` overrides a file that sets `tokens`.
"""

from __future__ import annotations

import json
import math
import re
import sys
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import tomli_w

from mambactl.errors import MambactlError
from mambactl.models.config import ModelConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on python 3.10 only
    import tomli as tomllib

FROM_TOKENIZER = "from_tokenizer"
ScheduleKind = Literal["constant", "cosine", "wsd"]
MatmulPrecision = Literal["fp32", "f16"]  # ops/linear.py's PRECISIONS

# (section, key) -> (the alternative key, its "off" value); see the module docstring.
_ALTERNATIVES = {
    ("train", "steps"): ("tokens", 0),
    ("train", "tokens"): ("steps", 0),
    ("tokenizer", "path"): ("vocab_size", 0),
    ("tokenizer", "vocab_size"): ("path", ""),
}
_PACKAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _show(value) -> str:
    """A value the way the user wrote it in TOML (strings quoted, booleans lower-case)."""
    return json.dumps(value)


def _need(ok: bool, key: str, allowed: str, value) -> None:
    if not ok:
        raise MambactlError(f"{key}: must be {allowed}, got {_show(value)}")


@dataclass
class DataConfig:
    """[data]: the training text. Empty `paths` -> the embedded default corpus (see train/data.py)."""

    paths: list[str] = field(default_factory=list)  # files, globs, directories, .jsonl files with a "text" field
    val_fraction: float = 0.05  # the last fraction of the tokens is the validation split
    cache_dir: str = ""  # token cache; "" -> $XDG_CACHE_HOME/mambactl/tokens (~/.cache/...)
    default_corpus_bytes: int = 2_000_000  # size cap of the embedded default corpus

    def __post_init__(self) -> None:
        _need(0 < self.val_fraction <= 0.5, "data.val_fraction", "in (0, 0.5]", self.val_fraction)
        _need(self.default_corpus_bytes >= 10_000, "data.default_corpus_bytes", "an integer >= 10000",
              self.default_corpus_bytes)


@dataclass
class TokenizerConfig:
    """[tokenizer]: load `path` (a tokenizer.json), or train a byte-level BPE of `vocab_size` tokens on the data."""

    path: str = ""
    vocab_size: int = 8192

    def __post_init__(self) -> None:
        _need(self.vocab_size == 0 or 257 <= self.vocab_size <= 2**31, "tokenizer.vocab_size",
              "0 (off) or an integer in [257, 2147483648]", self.vocab_size)
        if bool(self.path) == (self.vocab_size > 0):
            raise MambactlError("tokenizer.path, tokenizer.vocab_size: give exactly one "
                                "(a tokenizer.json to load, or the vocabulary size of one to train)")


@dataclass
class OptimConfig:
    """[optim]: AdamW with decoupled weight decay, global-norm clipping, a trust region and a NaN/Inf guard."""

    lr: float = 3e-4  # peak learning rate; the schedule scales it
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    max_delta: float = 0.0  # trust region: max |step| per element per update; 0 disables
    decay_embeddings: bool = False  # apply weight decay to the embedding (tied head) too

    def __post_init__(self) -> None:
        _need(self.lr > 0, "optim.lr", "a number > 0", self.lr)
        _need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas",
              "two numbers in [0, 1), e.g. [0.9, 0.95]", self.betas)
        _need(self.eps > 0, "optim.eps", "a number > 0", self.eps)
        _need(self.weight_decay >= 0, "optim.weight_decay", "a number >= 0", self.weight_decay)
        _need(self.grad_clip >= 0, "optim.grad_clip", "a number >= 0 (0 disables clipping)", self.grad_clip)
        _need(self.max_delta >= 0, "optim.max_delta", "a number >= 0 (0 disables the trust region)", self.max_delta)


@dataclass
class ScheduleConfig:
    """[schedule]: learning-rate schedule (train/schedule.py); every kind starts with a linear warmup."""

    kind: ScheduleKind = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine and wsd end at min_lr_ratio · optim.lr
    decay_fraction: float = 0.2  # wsd: the last fraction of the steps decays linearly

    def __post_init__(self) -> None:
        _need(self.warmup_steps >= 0, "schedule.warmup_steps", "an integer >= 0", self.warmup_steps)
        _need(0 <= self.min_lr_ratio <= 1, "schedule.min_lr_ratio", "in [0, 1]", self.min_lr_ratio)
        _need(0 < self.decay_fraction <= 1, "schedule.decay_fraction", "in (0, 1]", self.decay_fraction)


@dataclass
class LoopConfig:
    """[train]: batch shape, run length, intervals, seed, device, GEMM precision and output directory."""

    batch_size: int = 8  # sequences per micro-batch
    seq_len: int = 256  # tokens per sequence
    steps: int = 1000  # optimizer updates; or give `tokens` instead
    tokens: int = 0  # training tokens; steps = ceil(tokens / tokens_per_step)
    grad_accum: int = 1  # micro-batches per update
    eval_every: int = 100  # 0 disables evaluation
    eval_batches: int = 8
    checkpoint_every: int = 500  # 0 -> only at the end
    keep_checkpoints: int = 3
    log_every: int = 10
    seed: int = 0
    device: str = "auto"  # "auto", or an adapter index or name from `mambactl devices`
    matmul_precision: MatmulPrecision = "fp32"  # "f16": the GEMMs stage f16 operands (weights stay fp32)
    out_dir: str = "runs/default"

    def __post_init__(self) -> None:
        for key in ("batch_size", "seq_len", "grad_accum", "eval_batches", "keep_checkpoints", "log_every"):
            _need(getattr(self, key) >= 1, f"train.{key}", "an integer >= 1", getattr(self, key))
        for key in ("steps", "tokens", "eval_every", "checkpoint_every", "seed"):
            _need(getattr(self, key) >= 0, f"train.{key}", "an integer >= 0", getattr(self, key))
        if (self.steps > 0) == (self.tokens > 0):
            raise MambactlError("train.steps, train.tokens: give exactly one of the two as a positive integer")
        _need(self.device.strip() != "", "train.device", '"auto" or an adapter index or name', self.device)
        _need(self.out_dir.strip() != "", "train.out_dir", "a directory path", self.out_dir)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum

    @property
    def total_steps(self) -> int:
        """Optimizer updates in the run: `steps`, or enough updates to see `tokens` tokens."""
        return self.steps if self.steps > 0 else -(-self.tokens // self.tokens_per_step)


@dataclass
class PackageConfig:
    """[package]: name, version and model card of the `.evermind` written at the end."""

    name: str = "mamba-lm"
    version: str = "0.1.0"
    description: str = ""
    license: str = ""
    author: str = ""
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _need(_PACKAGE_NAME.fullmatch(self.name) is not None, "package.name",
              "letters, digits, '.', '_' or '-', starting with a letter or digit", self.name)
        _need(self.version.strip() != "", "package.version", "a non-empty string", self.version)


def _default_model() -> ModelConfig:
    return _model_from_table({}, "model")


@dataclass
class TrainConfig:
    """A whole training run. `model.vocab_size` stays "from_tokenizer" until `resolve_model` is called."""

    model: ModelConfig = field(default_factory=_default_model)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    package: PackageConfig = field(default_factory=PackageConfig)
    # [model] init_from: a .evermind package to fine-tune. Its architecture, weights and tokenizer are used;
    # the other [model] keys and [tokenizer] are then ignored.
    init_from: str = ""

    def resolve_model(self, tokenizer_vocab_size: int) -> ModelConfig:
        """The ModelConfig to build: "from_tokenizer" -> the tokenizer's size; an explicit size must equal it
        (a package pairs a model with its tokenizer one to one; padding is pad_vocab_size_multiple's job).
        Checked before any GPU work, so a run never trains a model it cannot package."""
        vocab = self.model.vocab_size
        if vocab == FROM_TOKENIZER:
            vocab = tokenizer_vocab_size
        elif vocab != tokenizer_vocab_size:
            raise MambactlError(f"model.vocab_size: {vocab} differs from the tokenizer's vocabulary "
                                f"({tokenizer_vocab_size}); use \"{FROM_TOKENIZER}\" or a tokenizer of that size")
        return ModelConfig.from_dict({**self.model.to_dict(), "vocab_size": vocab})

    def to_dict(self) -> dict:
        data = asdict(self)
        init_from = data.pop("init_from")
        if init_from:
            data["model"]["init_from"] = init_from
        return data

    def to_toml(self) -> str:
        """The resolved config (every key, defaults filled in) as TOML; `from_toml` reads it back equal."""
        return "# resolved mambactl training config\n" + tomli_w.dumps(self.to_dict())

    @classmethod
    def from_toml(cls, text: str, origin: str = "<config>") -> "TrainConfig":
        return cls.from_dict(_parse_toml(text, origin), origin)

    @classmethod
    def from_dict(cls, data: dict, origin: str = "<config>") -> "TrainConfig":
        """Validate a parsed TOML document; errors are prefixed with `origin` (the file, or file + override)."""
        try:
            return cls(**_sections(data))
        except MambactlError as exc:
            raise MambactlError(f"{origin}: {exc}") from None


def load_config(path: str | Path, overrides: typing.Iterable[str] = ()) -> TrainConfig:
    """Read and validate a config file, then apply "section.key=value" overrides in order.

    A value is parsed as a TOML value (`1e-3`, `true`, `["a.txt"]`), or taken as a bare string if it is not one
    (`train.device=cpu`). Each override is validated like the file and its errors name it. A command-line flag
    such as `--steps N` is the override "train.steps=N".
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MambactlError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MambactlError(f"{path}: cannot read the config: {exc}") from None
    return parse_config(text, str(path), overrides)


def parse_config(text: str, origin: str, overrides: typing.Iterable[str] = ()) -> TrainConfig:
    """`load_config` for TOML text (e.g. a preset); errors name `origin`."""
    raw = _parse_toml(text, origin)
    config = TrainConfig.from_dict(raw, origin)
    for item in overrides:
        origin_item = f"{origin} (--set {item})"
        keys, value = _parse_override(item, origin_item)
        _assign(raw, keys, value, origin_item)
        config = TrainConfig.from_dict(raw, origin_item)
    return config


def list_presets() -> list[str]:
    """Names of the starter configs shipped in mambactl/train/presets (copies of configs/*.toml)."""
    return sorted(p.name[:-5] for p in _presets_dir().iterdir() if p.name.endswith(".toml"))


def preset_text(name: str) -> str:
    """The commented TOML text of a preset."""
    if name not in list_presets():
        raise MambactlError(f"unknown preset {name!r}; available: {', '.join(list_presets())}")
    return _presets_dir().joinpath(f"{name}.toml").read_text(encoding="utf-8")


def _presets_dir():
    return resources.files("mambactl.train").joinpath("presets")


# --- parsing and type checking ------------------------------------------------------------------------------------


def _parse_toml(text: str, origin: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MambactlError(f"{origin}: invalid TOML: {exc}") from None


def _parse_override(item: str, origin: str) -> tuple[list[str], object]:
    """ "section.key=value" -> (["section", "key"], value)."""
    key, sep, text = item.partition("=")
    keys = key.strip().split(".")
    if not sep or len(keys) < 2 or not all(keys):
        raise MambactlError(f"{origin}: expected section.key=value, e.g. optim.lr=1e-3")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return keys, value


def _assign(raw: dict, keys: list[str], value, origin: str) -> None:
    """raw[k0][k1]...[kn] = value, creating tables; setting one of an alternative pair turns the other off."""
    table = raw
    for i, key in enumerate(keys[:-1]):
        table = table.setdefault(key, {})
        if not isinstance(table, dict):
            raise MambactlError(f"{origin}: {'.'.join(keys[:i + 1])}: is not a table")
    table[keys[-1]] = value
    if len(keys) == 2 and tuple(keys) in _ALTERNATIVES:
        other, off = _ALTERNATIVES[tuple(keys)]
        table[other] = off


_SECTIONS = {"model": None, "data": DataConfig, "tokenizer": TokenizerConfig, "optim": OptimConfig,
             "schedule": ScheduleConfig, "train": LoopConfig, "package": PackageConfig}


def _sections(data: dict) -> dict:
    """Parsed TOML -> TrainConfig keyword arguments, each section type-checked and validated."""
    for name, value in data.items():
        if name not in _SECTIONS:
            raise MambactlError(f"{name}: unknown section; allowed: {', '.join(_SECTIONS)}")
        if not isinstance(value, dict):
            raise MambactlError(f"{name}: must be a table ([{name}]), got {_show(value)}")
    out = {}
    for name, cls in _SECTIONS.items():
        table = dict(data.get(name, {}))
        for (section, key), (other, off) in _ALTERNATIVES.items():
            if section == name and key in table and other not in table:
                table[other] = off
        if cls is None:
            init_from = table.pop("init_from", "")
            if not isinstance(init_from, str):
                raise MambactlError(f"model.init_from: must be the path of a .evermind package, got {_show(init_from)}")
            out["init_from"] = init_from
        out[name] = _model_from_table(table, name) if cls is None else _typed(cls, table, name)
    return out


def _model_from_table(table: dict, where: str) -> ModelConfig:
    """[model] -> ModelConfig; `vocab_size` may be "from_tokenizer" (kept as that string on the result)."""
    table = dict(table)
    vocab = table.pop("vocab_size", FROM_TOKENIZER)
    is_int = isinstance(vocab, int) and not isinstance(vocab, bool)
    if not (is_int or vocab == FROM_TOKENIZER):
        raise MambactlError(f'{where}.vocab_size: must be an integer >= 2 or "{FROM_TOKENIZER}", got {_show(vocab)}')
    model = _typed(ModelConfig, {**table, "vocab_size": vocab if is_int else 256}, where)
    model.vocab_size = vocab  # validated above (int) or resolved later (resolve_model)
    return model


def _typed(cls, table: dict, where: str):
    """Check a TOML table against dataclass `cls`'s annotations, then construct it (which checks the ranges)."""
    if not isinstance(table, dict):
        raise MambactlError(f"{where}: must be a table, got {_show(table)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    kwargs = {}
    for key, value in table.items():
        if key not in names:
            raise MambactlError(f"{where}.{key}: unknown key; allowed: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)


def _coerce(value, hint, key: str):
    """`value` checked against type `hint` (ints widen to floats; a bool is not a number); raises naming `key`."""
    if is_dataclass(hint):
        return _typed(hint, value, key)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for member in args:
            try:
                return _coerce(value, member, key)
            except MambactlError:
                pass
    elif origin is list:
        if isinstance(value, list):
            try:
                return [_coerce(item, args[0], key) for item in value]
            except MambactlError:
                pass
    elif _matches(value, hint):
        if hint is float:
            _need(math.isfinite(value), key, "a finite number", value)
            return float(value)
        return value
    raise MambactlError(f"{key}: must be {_describe(hint)}, got {_show(value)}")


def _matches(value, hint) -> bool:
    if typing.get_origin(hint) is Literal:
        return isinstance(value, str) and value in typing.get_args(hint)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(_show(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is list:
        return "a list of " + {int: "integers", float: "numbers", str: "strings", bool: "booleans"}[args[0]]
    if is_dataclass(hint):
        return "a table"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[hint]
