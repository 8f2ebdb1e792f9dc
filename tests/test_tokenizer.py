"""Byte-level BPE tokenizers: training, the loadable formats, round trips, bad files and the CLI."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from mambactl.errors import MambactlError
from mambactl.package import load_tokenizer, tokenizer_summary, train_tokenizer
from mambactl.package.tokenizer import decode, encode, save_tokenizer, vocab_size

SAMPLE = "Hello wörld 🙂 — it's 2024-06-01, x=12345;\n\tdone.  <|endoftext|>"


def test_trained_tokenizer_is_byte_level_bpe_with_default_specials(pkg_tokenizer):
    data = json.loads(pkg_tokenizer.to_str())
    assert data["model"]["type"] == "BPE"
    assert data["pre_tokenizer"]["type"] == "ByteLevel" and data["pre_tokenizer"]["add_prefix_space"] is False
    assert data["decoder"]["type"] == "ByteLevel"
    assert tokenizer_summary(pkg_tokenizer) == {
        "type": "bpe-byte-level", "vocab_size": 320, "specials": {"<|endoftext|>": 0, "<|padding|>": 1}}
    assert encode(pkg_tokenizer, "<|endoftext|>") == [0]


def test_custom_specials_take_the_first_ids(pkg_corpus):
    tok = train_tokenizer([pkg_corpus], 300, specials=["<s>", "</s>", "<pad>"], progress=False)
    assert tokenizer_summary(tok)["specials"] == {"<s>": 0, "</s>": 1, "<pad>": 2}


def test_training_is_deterministic(pkg_corpus, pkg_tokenizer):
    assert train_tokenizer([pkg_corpus], 320, progress=False).to_str() == pkg_tokenizer.to_str()


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_decode_encode_round_trips_any_unicode(pkg_tokenizer, text):
    assert decode(pkg_tokenizer, encode(pkg_tokenizer, text)) == text


@pytest.mark.parametrize("legacy_merges", [False, True])
def test_hf_tokenizer_json_loads_with_either_merges_form(tmp_path, pkg_tokenizer, legacy_merges):
    data = json.loads(pkg_tokenizer.to_str())
    if legacy_merges:
        data["model"]["merges"] = [" ".join(pair) for pair in data["model"]["merges"]]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    for path in (tmp_path / "tokenizer.json", tmp_path):
        assert load_tokenizer(path).to_str() == pkg_tokenizer.to_str()


def test_hf_tokenizer_json_without_pre_tokenizer_or_decoder_gets_byte_level(tmp_path, pkg_tokenizer):
    data = json.loads(pkg_tokenizer.to_str())
    data["pre_tokenizer"] = data["decoder"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert encode(tok, SAMPLE) == encode(pkg_tokenizer, SAMPLE)
    assert decode(tok, encode(tok, SAMPLE)) == SAMPLE


def _vocab_and_merges(tok):
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], [" ".join(pair) for pair in model["merges"]]


def test_vocab_json_with_merges_txt(tmp_path, pkg_tokenizer):
    vocab, merges = _vocab_and_merges(pkg_tokenizer)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n\n", encoding="utf-8")
    for path in (tmp_path / "vocab.json", tmp_path):
        tok = load_tokenizer(path)
        assert encode(tok, SAMPLE) == encode(pkg_tokenizer, SAMPLE)
        assert tokenizer_summary(tok) == tokenizer_summary(pkg_tokenizer)


def test_old_engine_spec(tmp_path, pkg_tokenizer):
    vocab, merges = _vocab_and_merges(pkg_tokenizer)
    spec = {"vocab": vocab, "merges": merges,
            "specials": {"bos": "<|im_start|>", "eos": "<|im_end|>", "pad": "<|endoftext|>", "unk": None}}
    (tmp_path / "spec.json").write_text(json.dumps(spec, separators=(",", ":")), encoding="utf-8")
    tok = load_tokenizer(tmp_path / "spec.json")
    assert tokenizer_summary(tok)["specials"] == {"<|endoftext|>": 0}  # the others are not in the vocab
    assert decode(tok, encode(tok, SAMPLE)) == SAMPLE
    # The engine's pre-tokenizer: digits in groups of at most three, contractions split off.
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("it's 1234567")]
    assert pieces == ["it", "'s", "Ġ", "123", "456", "7"]


def test_old_engine_spec_takes_a_word_in_the_vocab_whole(tmp_path):
    """The engine returns a word that is in the vocab as one token, even when no merge chain builds it."""
    vocab = {s: i for i, s in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab.update({"ab": 256, "abc": 257})
    (tmp_path / "spec.json").write_text(json.dumps({"vocab": vocab, "merges": ["a b"]}), encoding="utf-8")
    tok = load_tokenizer(tmp_path / "spec.json")
    assert encode(tok, "abc") == [257]
    assert encode(tok, "abd") == [256, vocab["d"]]


def test_save_tokenizer_writes_loadable_json(tmp_path, pkg_tokenizer):
    save_tokenizer(pkg_tokenizer, tmp_path / "tok.json")
    assert load_tokenizer(tmp_path / "tok.json").to_str() == pkg_tokenizer.to_str()


BAD_FILES = {
    "not json": ("tok.json", "{vocab", "not a JSON tokenizer file"),
    "not utf-8": ("tok.json", b"\xff\xfe{}", "not a JSON tokenizer file"),
    "json list": ("tok.json", "[1, 2]", "not a tokenizer"),
    "wordpiece": ("tok.json", json.dumps({"model": {"type": "WordPiece", "vocab": {}}}), "not BPE"),
    "unigram pre-tokenizer": ("tok.json", json.dumps({"pre_tokenizer": {"type": "Metaspace"},
                                                      "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}),
                              "pre_tokenizer is not ByteLevel"),
    "missing byte symbols": ("tok.json", json.dumps({"vocab": {"a": 0, "b": 1}, "merges": []}),
                             "lacks 254 of the 256 byte-level symbols"),
    "merge of unknown token": ("tok.json", json.dumps({"vocab": {"a": 0}, "merges": ["a zz"]}), "invalid BPE"),
    "bad merge entry": ("tok.json", json.dumps({"vocab": {"a": 0}, "merges": [["a"]]}), "merges[0]"),
    "bad vocab id": ("tok.json", json.dumps({"vocab": {"a": -1}, "merges": []}), "vocab['a']"),
    "vocab.json without merges.txt": ("vocab.json", json.dumps({"a": 0}), "needs merges.txt"),
}


@pytest.mark.parametrize("case", BAD_FILES, ids=list(BAD_FILES))
def test_bad_tokenizer_files_are_one_line_errors_naming_the_file(tmp_path, case):
    name, content, needle = BAD_FILES[case]
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    with pytest.raises(MambactlError) as err:
        load_tokenizer(path)
    message = str(err.value)
    assert message.startswith(str(path)) and needle in message and "\n" not in message


def test_missing_paths_and_empty_directories(tmp_path):
    with pytest.raises(MambactlError, match="no such file"):
        load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(MambactlError, match="neither tokenizer.json nor vocab.json"):
        load_tokenizer(tmp_path)


def test_training_errors(tmp_path, pkg_corpus):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    cases = [
        (([pkg_corpus], 100), "below the minimum 258"),
        (([], 300), "no training files"),
        (([tmp_path / "missing.txt"], 300), "no such file"),
        (([tmp_path], 300), "is a directory"),
        (([tmp_path / "latin1.txt"], 300), "latin1.txt: not UTF-8"),
    ]
    for args, needle in cases:
        with pytest.raises(MambactlError, match=needle):
            train_tokenizer(*args, progress=False)
    with pytest.raises(MambactlError, match="distinct"):
        train_tokenizer([pkg_corpus], 300, specials=["<a>", "<a>"], progress=False)


def test_decode_rejects_ids_outside_the_vocab(pkg_tokenizer):
    with pytest.raises(MambactlError, match="outside the vocab"):
        decode(pkg_tokenizer, [vocab_size(pkg_tokenizer)])


def test_cli_train_encode_decode(pkg_cli, pkg_corpus):
    result = pkg_cli("tokenizer", "train", pkg_corpus, "--vocab-size", 300, "-o", "tok.json", "--no-progress",
                     "--special", "<|endoftext|>", "--special", "<|sep|>")
    assert result.returncode == 0, result.stderr
    assert "300 tokens" in result.stdout and "<|sep|> (1)" in result.stdout
    ids = pkg_cli("tokenizer", "encode", "tok.json", SAMPLE)
    assert ids.returncode == 0, ids.stderr
    text = pkg_cli("tokenizer", "decode", "tok.json", *ids.stdout.split())
    assert text.returncode == 0 and text.stdout == SAMPLE + "\n"
    from_stdin = pkg_cli("tokenizer", "decode", "tok.json", stdin=ids.stdout)
    assert from_stdin.stdout == SAMPLE + "\n"


def test_cli_errors_are_one_line(pkg_cli, pkg_one_line_error, tmp_path):
    (tmp_path / "tok.json").write_text("old", encoding="utf-8")
    pkg_one_line_error(pkg_cli("tokenizer", "train", "missing.txt", "--vocab-size", 300, "-o", "tok.json"),
                       "missing.txt: no such file")
    assert (tmp_path / "tok.json").read_text(encoding="utf-8") == "old"
    pkg_one_line_error(pkg_cli("tokenizer", "encode", "tok.json", "hi"), "tok.json: not a JSON tokenizer file")
