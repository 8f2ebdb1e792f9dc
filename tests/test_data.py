"""Text sources, the default corpus, the token cache, the train/validation split and the batch sampler."""

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mambactl.errors import MambactlError
from mambactl.train.config import DataConfig
from mambactl.train.data import (ENDOFTEXT, BatchSampler, default_corpus, iter_documents, resolve_sources,
                                 source_files, split_tokens, token_dtype, tokenize_cached)

TEXT = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # three\n" * 20


def train_tokenizer(texts, vocab_size=300) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[ENDOFTEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([TEXT, "hello world, the quick brown fox\n" * 10])


class CountingTokenizer:
    """Delegates to a real tokenizer and counts the texts it encodes."""

    def __init__(self, inner):
        self.inner, self.encoded = inner, 0

    def encode_batch(self, texts, add_special_tokens=True):
        self.encoded += len(texts)
        return self.inner.encode_batch(texts, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def corpus(tmp_path):
    """a.txt, notes/b.md, notes/deep/c.txt, notes/.hidden, d.jsonl (3 records, one empty)."""
    (tmp_path / "notes" / "deep").mkdir(parents=True)
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "notes" / "b.md").write_text("hello world\n")
    (tmp_path / "notes" / "deep" / "c.txt").write_text("the quick brown fox\n")
    (tmp_path / "notes" / ".hidden").write_text("secret")
    records = [{"text": "first record"}, {"text": ""}, {"text": "third record", "id": 3}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    return tmp_path


def test_sources_files_dirs_globs_in_order_without_duplicates(corpus):
    files = resolve_sources([str(corpus / "notes"), str(corpus / "*.txt"), str(corpus / "notes" / "b.md"),
                             str(corpus / "d.jsonl")])
    names = [p.relative_to(corpus).as_posix() for p in files]
    assert names == ["notes/b.md", "notes/deep/c.txt", "a.txt", "d.jsonl"]
    assert [p.name for p in resolve_sources([str(corpus / "**" / "*.txt")])] == ["a.txt", "c.txt"]


def test_documents_of_text_and_jsonl(corpus):
    docs = list(iter_documents([corpus / "notes" / "b.md", corpus / "d.jsonl"]))
    assert docs == ["hello world\n", "first record", "third record"]


@pytest.mark.parametrize("make,pattern,message", [
    (lambda d: None, "missing.txt", "does not exist"),
    (lambda d: None, "*.nothing", "no file matches"),
    (lambda d: (d / "empty").mkdir(), "empty", "no file matches"),
])
def test_source_errors(tmp_path, make, pattern, message):
    make(tmp_path)
    with pytest.raises(MambactlError, match=f"data.paths: .*{message}"):
        resolve_sources([str(tmp_path / pattern)])


@pytest.mark.parametrize("content,message", [
    ('{"text": "ok"}\nnot json\n', "x.jsonl:2: not valid JSON"),
    ('{"text": "ok"}\n{"body": "no text"}\n', 'x.jsonl:2: expected a JSON object with a string "text"'),
    ('["text"]\n', "x.jsonl:1: expected a JSON object"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, content, message):
    (tmp_path / "x.jsonl").write_text(content)
    with pytest.raises(MambactlError, match=message):
        list(iter_documents([tmp_path / "x.jsonl"]))


def test_binary_file_is_a_clear_error(tmp_path):
    (tmp_path / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(MambactlError, match="img.png: not UTF-8 text"):
        list(iter_documents([tmp_path / "img.png"]))


def test_default_corpus_is_a_sorted_prefix_of_the_stdlib_sources():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = default_corpus(300_000)
    assert files == default_corpus(300_000)
    assert sum(p.stat().st_size for p in files) <= 300_000
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel) and all(r.endswith(".py") and "test" not in r.split("/")[:-1] for r in rel)
    assert len(default_corpus(600_000)) > len(files)
    assert default_corpus(600_000)[: len(files)] == files
    assert source_files(DataConfig(default_corpus_bytes=300_000)) == files


def test_tokens_and_end_of_text(corpus, tokenizer, tmp_path):
    files = [corpus / "notes" / "b.md", corpus / "d.jsonl"]
    out = tokenize_cached(files, tokenizer, tmp_path / "cache")
    eot = tokenizer.token_to_id(ENDOFTEXT)
    expected = []
    for doc in ["hello world\n", "first record", "third record"]:
        expected += tokenizer.encode(doc, add_special_tokens=False).ids + [eot]
    assert out.tokens.dtype == np.uint16
    np.testing.assert_array_equal(out.tokens, expected)
    assert tokenizer.decode(list(out.tokens[: len(expected) // 2])).startswith("hello world")


def test_second_call_loads_the_cache_without_tokenizing(corpus, tokenizer, tmp_path):
    files = resolve_sources([str(corpus)])
    counting = CountingTokenizer(tokenizer)
    first = tokenize_cached(files, counting, tmp_path / "cache")
    assert not first.from_cache and counting.encoded > 0
    counting.encoded = 0
    mtime = first.path.stat().st_mtime_ns
    second = tokenize_cached(files, counting, tmp_path / "cache")
    assert second.from_cache and counting.encoded == 0
    assert second.path == first.path and second.path.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(second.tokens, first.tokens)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.path.name]  # no temp files left


def test_cache_key_follows_content_and_tokenizer(corpus, tokenizer, tmp_path):
    files = [corpus / "a.txt"]
    first = tokenize_cached(files, tokenizer, tmp_path)
    (corpus / "a.txt").write_text(TEXT.replace("three", "3"))
    edited = tokenize_cached(files, tokenizer, tmp_path)
    assert not edited.from_cache and edited.path != first.path
    other = tokenize_cached(files, train_tokenizer([TEXT], vocab_size=280), tmp_path)
    assert not other.from_cache and other.path != edited.path


def test_default_corpus_tokenizes(tokenizer, tmp_path):
    files = source_files(DataConfig(default_corpus_bytes=100_000))
    out = tokenize_cached(files, tokenizer, tmp_path)
    assert len(out.tokens) > 10_000
    assert int(np.sum(out.tokens == tokenizer.token_to_id(ENDOFTEXT))) == len(files)


def test_empty_text_is_an_error(tmp_path, tokenizer):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(MambactlError, match="no text"):
        tokenize_cached([tmp_path / "empty.txt"], tokenizer, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_token_dtype():
    assert token_dtype(512) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(200_000) == np.uint32


def test_split_is_the_tail_and_checks_length():
    tokens = np.arange(1000, dtype=np.uint16)
    train, val = split_tokens(tokens, 0.1, seq_len=50)
    np.testing.assert_array_equal(train, tokens[:900])
    np.testing.assert_array_equal(val, tokens[900:])
    with pytest.raises(MambactlError, match="too few for train.seq_len 100"):
        split_tokens(tokens, 0.1, seq_len=100)  # 100 validation tokens < 101


def test_sampler_windows_and_targets():
    tokens = np.arange(500, dtype=np.uint16)
    ids, targets = BatchSampler(tokens, batch_size=4, seq_len=16, seed=0).next_batch()
    assert ids.shape == targets.shape == (4, 16) and ids.dtype == targets.dtype == np.int32
    assert ids.flags.c_contiguous and targets.flags.c_contiguous
    np.testing.assert_array_equal(targets, ids + 1)
    np.testing.assert_array_equal(np.diff(ids, axis=1), 1)  # contiguous windows of the stream


def test_sampler_is_deterministic_and_covers_the_ends():
    tokens = np.arange(40, dtype=np.uint32)
    a, b = BatchSampler(tokens, 8, 8, seed=3), BatchSampler(tokens, 8, 8, seed=3)
    batches = [a.next_batch() for _ in range(200)]
    for ids, targets in batches[:5]:
        np.testing.assert_array_equal(ids, b.next_batch()[0])
    assert not np.array_equal(BatchSampler(tokens, 8, 8, seed=4).next_batch()[0], batches[0][0])
    starts = {int(s) for ids, _ in batches for s in ids[:, 0]}
    assert starts == set(range(32))  # every window start 0..N-L-1 occurs; the last target is token N-1


def test_sampler_state_resumes_exactly():
    tokens = np.arange(1000, dtype=np.uint16)
    straight = BatchSampler(tokens, 4, 32, seed=7)
    for _ in range(3):
        straight.next_batch()
    state = json.loads(json.dumps(straight.state_dict()))  # checkpoints store it as JSON
    expected = [straight.next_batch() for _ in range(3)]
    resumed = BatchSampler(tokens, 4, 32, seed=999)
    resumed.load_state_dict(state)
    assert resumed.batches_drawn == 3
    for (ids, targets), (e_ids, e_targets) in zip([resumed.next_batch() for _ in range(3)], expected):
        np.testing.assert_array_equal(ids, e_ids)
        np.testing.assert_array_equal(targets, e_targets)
    with pytest.raises(MambactlError, match="sampler state"):
        BatchSampler(tokens, 8, 32, seed=7).load_state_dict(state)


def test_sampler_needs_one_window():
    with pytest.raises(MambactlError, match="too few"):
        BatchSampler(np.arange(16), 2, 16, seed=0)
    BatchSampler(np.arange(17), 2, 16, seed=0).next_batch()
