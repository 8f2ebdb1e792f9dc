"""Byte-level BPE tokenizers: train, load from the formats in the wild, summarise, encode and decode.

Everything is a `tokenizers.Tokenizer` whose JSON form (`tokenizer.json`) is what a package embeds. Inputs accepted
by `load_tokenizer`, all normalised to a byte-level BPE `tokenizer.json`:

- an HF `tokenizer.json` (BPE model, merges as "a b" strings or ["a", "b"] pairs; a missing pre-tokenizer or
  decoder becomes GPT-2's ByteLevel one);
- a `vocab.json` with `merges.txt` beside it (GPT-2 style; vocab tokens spelled `<|...|>` become specials);
- the old engine's serialized spec `{vocab, merges, specials}` (also bare `{vocab, merges}`), kept faithful to how
  that engine split text: its pre-tokenizer regex and "a word already in the vocab is one token".

Every vocab must hold the 256 byte symbols, so any UTF-8 text encodes and `decode(encode(text)) == text`.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from mambactl.errors import MambactlError
from mambactl.package.checkpoint import atomic_write, first_line, require_file

DEFAULT_SPECIALS = ("<|endoftext|>", "<|padding|>")

# The old engine's pre-tokenizer (engine-notes §4): Qwen2-style with case-sensitive contractions.
ENGINE_SPLIT_REGEX = (
    r"(?:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_BYTE_SYMBOLS = tuple(pre_tokenizers.ByteLevel.alphabet())
_GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_BYTE_LEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
_SPECIAL_LOOKING = re.compile(r"<\|[^|\s]+\|>")


# training -------------------------------------------------------------------------------------------------------
def train_tokenizer(
    files: Iterable[str | Path],
    vocab_size: int,
    specials: Sequence[str] = DEFAULT_SPECIALS,
    progress: bool = True,
) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE on UTF-8 text files; `specials` take ids 0, 1, ... in order.

    The result has at most `vocab_size` tokens (fewer when the corpus runs out of pairs to merge).
    """
    paths = [Path(f) for f in files]
    if not paths:
        raise MambactlError("no training files given")
    for p in paths:
        require_file(p)
    specials = list(specials)
    if any(not isinstance(s, str) or not s for s in specials) or len(set(specials)) != len(specials):
        raise MambactlError(f"special tokens must be distinct non-empty strings, got {specials}")
    minimum = len(_BYTE_SYMBOLS) + len(specials)
    if vocab_size < minimum:
        raise MambactlError(f"vocab size {vocab_size} is below the minimum {minimum} "
                            f"(256 byte symbols + {len(specials)} special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=list(_BYTE_SYMBOLS), show_progress=progress)
    try:
        tok.train([str(p) for p in paths], trainer)
    except Exception as exc:  # the library raises a bare Exception, e.g. on invalid UTF-8
        bad = next((p for p in paths if not _is_utf8(p)), None)
        if bad is not None:
            raise MambactlError(f"{bad}: not UTF-8 text") from None
        raise MambactlError(f"tokenizer training failed: {first_line(exc)}") from None
    return tok


def _is_utf8(path: Path) -> bool:
    """Whether a file decodes as UTF-8 (read in 1 MiB chunks)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                decoder.decode(chunk)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


# loading --------------------------------------------------------------------------------------------------------
def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer file or directory (see the module docstring for the formats) as byte-level BPE."""
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            path = path / "vocab.json"
        else:
            raise MambactlError(f"{path}: directory holds neither tokenizer.json nor vocab.json + merges.txt")
    require_file(path)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise MambactlError(f"{path}: not a JSON tokenizer file ({first_line(exc)})") from None
    try:
        if isinstance(data, dict) and "model" in data:
            return _from_hf(data)
        if isinstance(data, dict) and "vocab" in data and "merges" in data:
            return _from_engine_spec(data)
        if isinstance(data, dict) and data and all(type(v) is int for v in data.values()):
            return _from_vocab_and_merges(data, path.with_name("merges.txt"))
        raise MambactlError("not a tokenizer: expected an HF tokenizer.json, a vocab.json (with merges.txt "
                            "beside it) or a {vocab, merges, specials} spec")
    except MambactlError as exc:
        raise MambactlError(f"{path}: {exc}") from None


def parse_tokenizer_json(text: str) -> Tokenizer:
    """Parse an HF tokenizer.json string (a package's tokenizer section), checking it is byte-level BPE."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise MambactlError(f"not JSON ({first_line(exc)})") from None
    if not isinstance(data, dict) or "model" not in data:
        raise MambactlError("not an HF tokenizer.json (no 'model')")
    return _from_hf(data)


def _from_hf(data: dict) -> Tokenizer:
    model = data["model"]
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else type(model).__name__
        raise MambactlError(f"model type {kind!r} is not BPE; mambactl uses byte-level BPE tokenizers")
    data = dict(data)
    for key, default, children in (("pre_tokenizer", _GPT2_PRE_TOKENIZER, "pretokenizers"),
                                   ("decoder", _BYTE_LEVEL_DECODER, "decoders")):
        if data.get(key) is None:
            data[key] = default
        elif not _has_byte_level(data[key], children):
            raise MambactlError(f"{key} is not ByteLevel, so this is not a byte-level BPE tokenizer")
    try:
        tok = Tokenizer.from_str(json.dumps(data))
    except Exception as exc:  # the library raises a bare Exception naming the bad field
        raise MambactlError(f"invalid tokenizer.json: {first_line(exc)}") from None
    _check_byte_symbols(tok)
    return tok


def _has_byte_level(component: Any, children_key: str) -> bool:
    """True if a pre_tokenizer/decoder JSON object is ByteLevel or a Sequence containing one."""
    if not isinstance(component, dict):
        return False
    if component.get("type") == "ByteLevel":
        return True
    children = component.get(children_key)
    return component.get("type") == "Sequence" and isinstance(children, list) and any(
        isinstance(c, dict) and c.get("type") == "ByteLevel" for c in children)


def _from_engine_spec(data: dict) -> Tokenizer:
    specials = data.get("specials") or {}
    if not isinstance(specials, dict) or any(v is not None and not isinstance(v, str) for v in specials.values()):
        raise MambactlError("specials must be an object of token strings (or null)")
    vocab = _check_vocab(data["vocab"])
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(ENGINE_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    present = [s for s in specials.values() if s in vocab]
    return _build(vocab, _check_merges(data["merges"]), pre, present, ignore_merges=True)


def _from_vocab_and_merges(vocab: dict, merges_path: Path) -> Tokenizer:
    if not merges_path.is_file():
        raise MambactlError(f"a vocab.json needs merges.txt beside it ({merges_path} not found)")
    try:
        lines = merges_path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise MambactlError(f"{merges_path} is not UTF-8 text") from None
    merges = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    vocab = _check_vocab(vocab)
    specials = [t for t in vocab if _SPECIAL_LOOKING.fullmatch(t)]
    return _build(vocab, _check_merges(merges, merges_path.name), pre_tokenizers.ByteLevel(add_prefix_space=False),
                  specials, ignore_merges=False)


def _build(vocab: dict[str, int], merges: list[tuple[str, str]], pre_tokenizer, specials: list[str],
           ignore_merges: bool) -> Tokenizer:
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    except Exception as exc:  # e.g. a merge naming a token that is not in the vocab
        raise MambactlError(f"invalid BPE: {first_line(exc)}") from None
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    _check_byte_symbols(tok)
    return tok


def _check_vocab(vocab: Any) -> dict[str, int]:
    if not isinstance(vocab, dict) or not vocab:
        raise MambactlError("vocab must be a non-empty object of token -> id")
    seen: dict[int, str] = {}
    for token, i in vocab.items():
        if type(i) is not int or i < 0:
            raise MambactlError(f"vocab[{token!r}] must be a non-negative integer id, got {i!r}")
        if i in seen:
            raise MambactlError(f"vocab id {i} is used by both {seen[i]!r} and {token!r}")
        seen[i] = token
    return vocab


def _check_merges(merges: Any, where: str = "merges") -> list[tuple[str, str]]:
    """Merges as "a b" strings or ["a", "b"] pairs -> pairs, in rank order."""
    if not isinstance(merges, list):
        raise MambactlError(f"{where} must be a list")
    pairs = []
    for i, m in enumerate(merges):
        pair = m.split(" ") if isinstance(m, str) else m
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) and p for p in pair)):
            raise MambactlError(f'{where}[{i}]: expected "a b" or ["a", "b"], got {m!r}')
        pairs.append((pair[0], pair[1]))
    return pairs


def _check_byte_symbols(tok: Tokenizer) -> None:
    vocab = tok.get_vocab(with_added_tokens=False)
    missing = [s for s in _BYTE_SYMBOLS if s not in vocab]
    if missing:
        raise MambactlError(f"the vocab lacks {len(missing)} of the 256 byte-level symbols (e.g. {missing[0]!r}), "
                            "so some text could not be encoded")


# using ----------------------------------------------------------------------------------------------------------
def vocab_size(tok: Tokenizer) -> int:
    """Rows an embedding needs for this tokenizer: the largest id + 1 (added tokens included)."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def tokenizer_summary(tok: Tokenizer) -> dict:
    """{"type": "bpe-byte-level", "vocab_size": int, "specials": {token: id} in id order}."""
    added = sorted(tok.get_added_tokens_decoder().items())
    return {"type": "bpe-byte-level", "vocab_size": vocab_size(tok),
            "specials": {t.content: i for i, t in added if t.special}}


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of `text`, with no BOS/EOS added."""
    return tok.encode(text, add_special_tokens=False).ids


def decode(tok: Tokenizer, ids: Sequence[int]) -> str:
    """Text of token ids, special tokens included; an id outside the vocab is an error."""
    n = vocab_size(tok)
    bad = next((i for i in ids if not 0 <= i < n), None)
    if bad is not None:
        raise MambactlError(f"token id {bad} is outside the vocab (0..{n - 1})")
    return tok.decode(list(ids), skip_special_tokens=False)


def save_tokenizer(tok: Tokenizer, path: str | Path) -> None:
    """Write `tok` as a pretty-printed tokenizer.json, atomically."""
    atomic_write(Path(path), [tok.to_str(pretty=True).encode("utf-8")])
