"""Training text -> a cached token file -> random [B, L] windows.

1. `source_files(cfg.data)`: the files listed in `data.paths` (files, globs, directories searched recursively,
   `.jsonl` files with a "text" field per line), or, when it is empty, the embedded default corpus: the
   Python standard library's own `.py` sources, which ship with every Python, so training needs no download.
2. `iter_documents(files)`: their text, one document per text file or JSONL line (e.g. to train a tokenizer).
3. `tokenize_cached(files, tokenizer, cache_dir)`: encoded once with `encode_batch`, each document followed by the
   `<|endoftext|>` id when the tokenizer has one, written atomically as a raw uint16 (vocab <= 65536) or uint32
   file named by a SHA-256 of the files' bytes and the tokenizer JSON; a later run memory-maps it instantly.
4. `split_tokens`: the last `val_fraction` of the tokens is the validation split.
5. `BatchSampler`: seeded random windows; its state goes into checkpoints so a resumed run draws the same batches.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from mambactl.errors import MambactlError

ENDOFTEXT = "<|endoftext|>"
_FORMAT = b"mambactl-tokens-1"  # bump when the token file layout or the document rules change
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_PIECE_CHARS = 1 << 20  # long documents are encoded in pieces cut at line ends, so encode_batch uses all cores
_BATCH_CHARS = 8 << 20  # text per encode_batch call


def source_files(cfg) -> list[Path]:
    """The files a [data] section (train.config.DataConfig) names, or the default corpus when `paths` is empty."""
    return resolve_sources(cfg.paths) if cfg.paths else default_corpus(cfg.default_corpus_bytes)


def resolve_sources(patterns: list[str]) -> list[Path]:
    """Files, globs (`**` recurses) and directories (all non-hidden files, recursively) -> files, sorted per
    entry, in the order given, without duplicates. Raises naming the first entry that matches nothing."""
    out: dict[Path, None] = {}
    for pattern in patterns:
        path = Path(pattern).expanduser()
        if path.is_dir():
            matches = _files_under(path)
        elif path.is_file():
            matches = [path]
        elif glob.has_magic(pattern):
            matches = []
            for hit in sorted(glob.glob(str(path), recursive=True)):
                matches += _files_under(Path(hit)) if Path(hit).is_dir() else [Path(hit)]
        else:
            raise MambactlError(f"data.paths: {pattern!r} does not exist")
        if not matches:
            raise MambactlError(f"data.paths: no file matches {pattern!r}")
        out.update(dict.fromkeys(matches))
    return list(out)


def _files_under(directory: Path) -> list[Path]:
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(root, f) for f in files if not f.startswith(".")]
    return sorted(found)


def default_corpus(max_bytes: int) -> list[Path]:
    """The embedded default corpus: the standard library's `.py` files (tests and site-packages left out), sorted
    by relative path; the longest prefix of that list whose total size is <= max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP and not d.startswith(".")]
        found += [Path(dirpath, f) for f in files if f.endswith(".py")]
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    chosen, total = [], 0
    for path in found:
        total += path.stat().st_size
        if total > max_bytes:
            break
        chosen.append(path)
    if not chosen:
        raise MambactlError(f"data.paths is empty and the default corpus (the standard library's .py files under "
                            f"{root}) was not found; list your text files in data.paths")
    return chosen


def iter_documents(files: list[Path]) -> Iterator[str]:
    """The non-empty documents of `files`: a whole text file, or the "text" field of each JSONL line."""
    for path in files:
        if path.suffix == ".jsonl":
            yield from _jsonl_documents(path)
        else:
            text = _read_text(path)
            if text:
                yield text


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MambactlError(f"{path}: not UTF-8 text (byte {exc.start}); list only text files in data.paths") from None
    except OSError as exc:
        raise MambactlError(f"{path}: cannot read: {exc.strerror}") from None


def _jsonl_documents(path: Path) -> Iterator[str]:
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MambactlError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise MambactlError(f'{path}:{number}: expected a JSON object with a string "text" field')
        if record["text"]:
            yield record["text"]


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/mambactl/tokens, or ~/.cache/mambactl/tokens."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mambactl" / "tokens"


@dataclass
class TokenFile:
    tokens: np.memmap  # [N] uint16 or uint32, read-only
    path: Path
    from_cache: bool  # False when this call tokenized the text


def tokenize_cached(files: list[Path], tokenizer, cache_dir: str | Path = "") -> TokenFile:
    """All documents of `files` as one token stream [N], each document followed by `<|endoftext|>` (if the
    tokenizer has it); loaded from `cache_dir` ("" -> default_cache_dir()) when the same bytes were tokenized
    with the same tokenizer before, else encoded and written there atomically.

    `tokenizer` is a `tokenizers.Tokenizer` (anything with to_str, get_vocab_size, token_to_id, encode_batch).
    """
    dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    directory = Path(cache_dir) if cache_dir else default_cache_dir()
    path = directory / f"{_cache_key(files, tokenizer)}.{dtype.name}"
    from_cache = path.exists()
    if not from_cache:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                count = _write_tokens(files, tokenizer, dtype, out)
                out.flush()
                os.fsync(out.fileno())
            if count == 0:
                raise MambactlError("data: the files hold no text (every document is empty)")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return TokenFile(np.memmap(path, dtype=dtype, mode="r"), path, from_cache)


def _cache_key(files: list[Path], tokenizer) -> str:
    """SHA-256 of the format version, the tokenizer JSON and each file's kind, length and bytes, in order."""
    digest = hashlib.sha256(_FORMAT)
    tok = tokenizer.to_str().encode()
    digest.update(len(tok).to_bytes(8, "little") + tok)
    for path in files:
        size = path.stat().st_size
        digest.update((b"jsonl" if path.suffix == ".jsonl" else b"text ") + size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()[:32]


def _write_tokens(files: list[Path], tokenizer, dtype: np.dtype, out) -> int:
    """Encode every document of `files` into `out` as raw `dtype` ids; returns the number of tokens written."""
    eot = tokenizer.token_to_id(ENDOFTEXT)
    count = 0
    for batch in _batches(iter_documents(files)):
        encodings = tokenizer.encode_batch([text for text, _ in batch], add_special_tokens=False)
        ids: list[int] = []
        for encoding, (_, ends_document) in zip(encodings, batch):
            ids += encoding.ids
            if ends_document and eot is not None:
                ids.append(eot)
        np.asarray(ids, dtype=dtype).tofile(out)
        count += len(ids)
    return count


def _batches(documents: Iterator[str]) -> Iterator[list[tuple[str, bool]]]:
    """Documents -> lists of (piece, ends_document) holding about _BATCH_CHARS characters each."""
    batch, size = [], 0
    for document in documents:
        start = 0
        while start < len(document):
            end = document.find("\n", start + _PIECE_CHARS)
            end = len(document) if end < 0 else end + 1
            batch.append((document[start:end], end == len(document)))
            size += end - start
            start = end
            if size >= _BATCH_CHARS:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def split_tokens(tokens: np.ndarray, val_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens [N] -> (train [N − n_val], validation [n_val]) with n_val = floor(N · val_fraction), the tail.

    Each split must hold at least one window of seq_len + 1 tokens.
    """
    n = len(tokens)
    n_val = int(n * val_fraction)
    if min(n_val, n - n_val) < seq_len + 1:
        raise MambactlError(f"data: the corpus has {n} tokens, too few for train.seq_len {seq_len} with "
                            f"data.val_fraction {val_fraction} (each split needs at least {seq_len + 1}); "
                            f"add text or lower train.seq_len")
    return tokens[: n - n_val], tokens[n - n_val:]


class BatchSampler:
    """Random windows of a token stream: `next_batch()` -> (ids [B, L], targets [B, L]) int32, where
    targets[b, t] is the token after ids[b, t]. Window starts are drawn uniformly by a seeded numpy Generator.

    For evaluation, a fresh BatchSampler over the validation split with a fixed seed gives the same windows
    every time.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
        if len(tokens) < seq_len + 1:
            raise MambactlError(f"data: {len(tokens)} tokens are too few for one window of train.seq_len "
                                f"{seq_len} (+1 target); add text or lower train.seq_len")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.batches_drawn = 0
        self._rng = np.random.default_rng(seed)
        self._offsets = np.arange(seq_len + 1)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        starts = self._rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        windows = np.asarray(self.tokens[starts[:, None] + self._offsets], dtype=np.int32)  # [B, L + 1]
        self.batches_drawn += 1
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])

    def state_dict(self) -> dict:
        """JSON-serialisable state (the generator state holds integers wider than 64 bits)."""
        return {"rng": self._rng.bit_generator.state, "batches_drawn": self.batches_drawn,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "n_tokens": len(self.tokens)}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the sampler that wrote `state` stopped; it must have drawn the same shapes."""
        mine = (self.batch_size, self.seq_len, len(self.tokens))
        theirs = (state["batch_size"], state["seq_len"], state["n_tokens"])
        if mine != theirs:
            raise MambactlError(f"data sampler state is for (batch_size, seq_len, tokens) = {theirs}, "
                                f"this run has {mine}; resume with the config and data of the checkpoint")
        self._rng.bit_generator.state = state["rng"]
        self.batches_drawn = state["batches_drawn"]
