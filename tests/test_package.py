"""The `.evermind` v2 package: layout, round trips, determinism, every bad input, fuzzing, v1 reading, the CLI."""

import hashlib
import json
import struct

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from mambactl.errors import MambactlError
from mambactl.models.params import parameter_specs
from mambactl.package import (describe, load, load_checkpoint_weights, read_manifest, save_checkpoint_weights,
                              train_tokenizer, verify, write_package)
from mambactl.package import evermind
from mambactl.package.checkpoint import atomic_write

EPOCH = 1_700_000_000  # 2023-11-14T22:13:20Z
CARD = {"description": "A tiny test model.", "license": "MIT", "author": "tests", "tags": ["tiny", "test"],
        "training_summary": "none"}
PROVENANCE = {"training_config": "[train]\nsteps = 7\n", "steps": 7, "tokens_seen": 896,
              "final_losses": {"train": 5.5, "val": 5.75}}


def _write(path, cfg, weights, tok, **kw):
    args = {"name": "tiny", "version": "1.0", "card": CARD, "provenance": PROVENANCE,
            "extra_sections": {"card": ("markdown", b"# tiny\n")}, **kw}
    return write_package(path, cfg, weights, tok, **args)


@pytest.fixture
def package(tmp_path, pkg_model, pkg_tokenizer, monkeypatch):
    """A valid package at tmp_path/model.evermind with sections weights, tokenizer, card."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", str(EPOCH))
    path = tmp_path / "model.evermind"
    _write(path, *pkg_model, pkg_tokenizer)
    return path


def _load_error(path, verify=True) -> str:
    """The message of the MambactlError that loading `path` raises; it must be one line naming the file."""
    with pytest.raises(MambactlError) as err:
        load(path, verify=verify)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


def _layout(data: bytes) -> tuple[int, dict, int]:
    """(manifest length, manifest, first data offset) of package bytes."""
    (length,) = struct.unpack_from("<I", data, 8)
    return length, json.loads(data[12:12 + length]), evermind._align(12 + length + 32)


def _repack(data: bytes, mutate) -> bytes:
    """Package bytes with the manifest rewritten by `mutate` and a valid manifest digest.

    `mutate(manifest)` sees section offsets relative to the data start (so the sections keep their layout however
    long the new manifest is) and returns the new manifest, or raw bytes to store as the manifest.
    """
    _, manifest, old_start = _layout(data)
    for s in manifest["sections"]:
        s["offset"] -= old_start
    new, start = mutate(manifest), 0
    while True:
        if isinstance(new, bytes):
            body = new
        else:
            shifted = json.loads(json.dumps(new))
            for s in shifted.get("sections", []) if isinstance(shifted.get("sections"), list) else []:
                if isinstance(s, dict) and type(s.get("offset")) is int:
                    s["offset"] += start
            body = json.dumps(shifted).encode()
        aligned = evermind._align(12 + len(body) + 32)
        if aligned == start:
            break
        start = aligned
    head = struct.pack("<III", evermind.MAGIC, 2, len(body)) + body
    head += hashlib.sha256(head).digest()
    return head + bytes(start - len(head)) + data[old_start:]


def _assemble(manifest: dict, payloads: list[tuple[str, str, bytes]]) -> bytes:
    """A package from a manifest and new section payloads, laid out and hashed as the writer does."""
    head = evermind._place_sections(manifest, payloads)
    return b"".join(evermind._file_chunks(head, manifest["sections"], payloads))


def _sections(path) -> dict:
    return {s["name"]: s for s in read_manifest(path)["sections"]}


# round trips and layout -----------------------------------------------------------------------------------------
def test_write_load_round_trip(package, pkg_model, pkg_tokenizer):
    cfg, weights = pkg_model
    pkg = load(package)
    assert "weights" not in pkg.__dict__  # mapped lazily
    assert pkg.config == cfg
    assert pkg.tokenizer.to_str() == pkg_tokenizer.to_str()
    assert list(pkg.weights) == [s.name for s in parameter_specs(cfg)]
    for name, value in weights.items():
        assert pkg.weights[name].dtype == np.float32 and np.array_equal(pkg.weights[name], value)
    assert bytes(pkg.section("card")) == b"# tiny\n"
    m = pkg.manifest
    assert m["schema"] == "evermind.model/2" and m["name"] == "tiny" and m["version"] == "1.0"
    assert m["model_type"] == "mamba-lm" and m["dtype"] == "F32" and m["config"] == cfg.to_dict()
    assert m["param_count"] == sum(v.size for v in weights.values())
    assert m["tokenizer"] == {"type": "bpe-byte-level", "vocab_size": cfg.vocab_size,
                              "specials": {"<|endoftext|>": 0, "<|padding|>": 1}}
    assert m["card"] == CARD and m["provenance"] == {"mambactl_version": "0.1.0", **PROVENANCE}
    assert m["created_at"] == "2023-11-14T22:13:20Z"
    assert verify(package) == m


def test_layout_matches_the_spec(package, pkg_model, pkg_tokenizer):
    data = package.read_bytes()
    assert data[:8] == b"1MVE\x02\x00\x00\x00"
    length, manifest, start = _layout(data)
    assert data[12 + length:12 + length + 32] == hashlib.sha256(data[:12 + length]).digest()
    assert set(data[12 + length + 32:start]) <= {0}
    sections = manifest["sections"]
    assert [s["name"] for s in sections] == ["weights", "tokenizer", "card"]
    assert sections[0]["offset"] == start and sections[-1]["offset"] + sections[-1]["length"] == len(data)
    for s in sections:
        blob = data[s["offset"]:s["offset"] + s["length"]]
        assert s["offset"] % 64 == 0 and hashlib.sha256(blob).hexdigest() == s["sha256"]
    weights = data[sections[0]["offset"]:][:sections[0]["length"]]
    loaded = safetensors.numpy.load(weights)  # the safetensors library reads the extracted bytes
    assert all(np.array_equal(loaded[k], v) for k, v in pkg_model[1].items())
    tokenizer = data[sections[1]["offset"]:][:sections[1]["length"]]
    assert Tokenizer.from_str(tokenizer.decode()).to_str() == pkg_tokenizer.to_str()


def test_identical_inputs_give_identical_bytes(package, pkg_model, pkg_tokenizer):
    again = package.with_name("again.evermind")
    _write(again, *pkg_model, pkg_tokenizer)
    assert again.read_bytes() == package.read_bytes()


def test_f16_weights(tmp_path, pkg_model, pkg_tokenizer):
    cfg, weights = pkg_model
    _write(tmp_path / "h.evermind", cfg, weights, pkg_tokenizer, dtype="F16")
    pkg = load(tmp_path / "h.evermind")
    assert pkg.manifest["dtype"] == "F16"
    for name, value in weights.items():
        assert pkg.weights[name].dtype == np.float32
        np.testing.assert_allclose(pkg.weights[name], value, rtol=1e-3, atol=1e-6)


def _bf16_blob(weights: dict) -> bytes:
    """A safetensors blob of BF16 tensors (numpy has no bfloat16: truncate float32 to its top 16 bits)."""
    header, chunks, offset = {}, [], 0
    for name in sorted(weights):
        raw = (weights[name].view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(weights[name].shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def test_bf16_weights_are_read(tmp_path, package, pkg_model):
    weights = pkg_model[1]
    manifest = read_manifest(package)
    manifest["dtype"] = "BF16"
    tokenizer = bytes(load(package).section("tokenizer"))
    (tmp_path / "b.evermind").write_bytes(_assemble(manifest, [("weights", "safetensors", _bf16_blob(weights)),
                                                               ("tokenizer", "tokenizer.json", tokenizer)]))
    pkg = load(tmp_path / "b.evermind")
    for name, value in weights.items():
        np.testing.assert_allclose(pkg.weights[name], value, rtol=1e-2, atol=1e-6)


def test_describe_does_not_read_the_weights_unless_verifying(package):
    weights = _sections(package)["weights"]
    data = bytearray(package.read_bytes())
    data[weights["offset"] + weights["length"] - 1] ^= 0xFF  # the last byte of tensor data
    package.write_bytes(bytes(data))
    facts = describe(package)
    assert facts["loadable"] and not facts["verified"] and facts["tokenizer"]["vocab_size"] == 320
    assert [p["name"] for p in facts["parameters"]][0] == "backbone.embeddings.weight"
    with pytest.raises(MambactlError, match="section 'weights' is corrupt"):
        describe(package, verify=True)


# bad input ------------------------------------------------------------------------------------------------------
def test_truncated_at_every_section_boundary(package):
    data = package.read_bytes()
    length, manifest, start = _layout(data)
    cuts = {0, 4, 8, 11, 12, 12 + length, 12 + length + 32, start, len(data) - 1}
    for s in manifest["sections"]:
        cuts |= {s["offset"], s["offset"] + 1, s["offset"] + s["length"] - 1, s["offset"] + s["length"]}
    cuts.discard(len(data))
    for cut in sorted(cuts):
        package.write_bytes(data[:cut])
        message = _load_error(package)
        assert any(k in message for k in ("too short", "runs past the end")), (cut, message)
        with pytest.raises(MambactlError):
            read_manifest(package)


def test_flipped_bytes_in_the_manifest_and_header(package):
    data = package.read_bytes()
    length, _, _ = _layout(data)
    expected = {0: "not an .evermind package", 4: "format version", 11: "manifest length", 8: "manifest is corrupt",
                12: "manifest is corrupt", 12 + length // 2: "manifest is corrupt", 11 + length: "manifest is corrupt",
                12 + length: "manifest is corrupt", 12 + length + 31: "manifest is corrupt"}
    for position, needle in expected.items():
        flipped = bytearray(data)
        flipped[position] ^= 0x40
        package.write_bytes(bytes(flipped))
        assert needle in _load_error(package), position
        assert needle in _load_error(package, verify=False), position


def test_flipped_bytes_in_each_section_name_the_section(package):
    data = package.read_bytes()
    for s in _sections(package).values():
        for position in (s["offset"], s["offset"] + s["length"] // 2, s["offset"] + s["length"] - 1):
            flipped = bytearray(data)
            flipped[position] ^= 0x01
            package.write_bytes(bytes(flipped))
            assert f"section '{s['name']}' is corrupt" in _load_error(package)


def test_nonzero_padding_between_sections(package):
    data = package.read_bytes()
    weights = _sections(package)["weights"]
    flipped = bytearray(data)
    flipped[weights["offset"] + weights["length"]] = 1  # the first padding byte after the weights
    package.write_bytes(bytes(flipped))
    assert "the padding before section 'tokenizer' is not zero bytes" in _load_error(package, verify=False)


def test_wrong_magic_and_version(package):
    data = package.read_bytes()
    package.write_bytes(b"GGUF" + data[4:])
    assert "not an .evermind package (magic 0x46554747" in _load_error(package)
    package.write_bytes(data[:4] + struct.pack("<I", 3) + data[8:])
    assert "format version 3 is not supported" in _load_error(package)


def test_absurd_lengths(package):
    data = package.read_bytes()
    for length in (len(data), 0xFFFF_FFFF):
        package.write_bytes(data[:8] + struct.pack("<I", length) + data[12:])
        assert f"manifest length {length} runs past the end" in _load_error(package)
    for key in ("offset", "length"):
        def huge(m, key=key):
            m["sections"][0][key] += 2**41
            return m

        package.write_bytes(_repack(data, huge))
        assert "section 'weights'" in (message := _load_error(package)) and "runs past the end" in message
    package.write_bytes(data)
    weights = _sections(package)["weights"]
    patched = bytearray(data)
    patched[weights["offset"]:weights["offset"] + 8] = struct.pack("<Q", 2**41)
    package.write_bytes(bytes(patched))
    assert "safetensors header length 2199023255552 runs past the section" in _load_error(package, verify=False)


MANIFEST_DEFECTS = {
    "not JSON": (lambda m: b"{not json", "manifest is not valid JSON"),
    "not UTF-8": (lambda m: b'{"a": "\xff"}', "manifest is not valid JSON"),
    "JSON array": (lambda m: b"[1, 2, 3]", "manifest is a JSON list, expected an object"),
    "wrong schema": (lambda m: {**m, "schema": "evermind.model/9"}, "manifest schema"),
    "wrong model type": (lambda m: {**m, "model_type": "gpt"}, "model type 'gpt'"),
    "param_count text": (lambda m: {**m, "param_count": "many"}, "param_count must be"),
    "param_count off": (lambda m: {**m, "param_count": m["param_count"] + 1}, "param_count"),
    "bad dtype": (lambda m: {**m, "dtype": "F64"}, "dtype must be one of"),
    "bad card": (lambda m: {**m, "card": {**m["card"], "tags": "x"}}, "card.tags"),
    "unknown card key": (lambda m: {**m, "card": {"descripton": "typo"}}, "card.descripton: unknown key"),
    "bad losses": (lambda m: {**m, "provenance": {"final_losses": {"val": "nan"}}}, "final_losses"),
    "bad config": (lambda m: {**m, "config": {**m["config"], "d_model": "wide"}}, "manifest config"),
    "config with wrong types": (lambda m: {**m, "config": {**m["config"], "norm_eps": "x"}}, "invalid model config"),
    "huge n_layer": (lambda m: {**m, "config": {**m["config"], "n_layer": 10**12, "layers": []}},
                     "layers but the weights hold only"),
    "config vocab": (lambda m: {**m, "config": {**m["config"], "vocab_size": 400}}, "parameter"),
    "bad tokenizer summary": (lambda m: {**m, "tokenizer": {"vocab_size": -1}}, "manifest tokenizer"),
    "sections not a list": (lambda m: {**m, "sections": {}}, "sections must be a list"),
    "section without hash": (lambda m: {**m, "sections": [{k: v for k, v in s.items() if k != "sha256"}
                                                          for s in m["sections"]]}, "sections[0] must have"),
    "misaligned section": (lambda m: {**m, "sections": [{**m["sections"][0], "offset": m["sections"][0]["offset"] + 1},
                                                        *m["sections"][1:]]}, "is at offset"),
    "overlapping sections": (lambda m: {**m, "sections": [m["sections"][0], {**m["sections"][1],
                                                                             "offset": m["sections"][0]["offset"]}]},
                             "the first 64-byte boundary after the previous section"),
    "duplicate section": (lambda m: {**m, "sections": [m["sections"][0], m["sections"][0]]}, "appears twice"),
    "no tokenizer section": (lambda m: {**m, "sections": [m["sections"][0], m["sections"][2]]},
                             "no 'tokenizer' section"),
    "weights not safetensors": (lambda m: {**m, "sections": [{**m["sections"][0], "format": "npz"},
                                                             *m["sections"][1:]]}, "no 'weights' section"),
    "bytes after the last section": (lambda m: {**m, "sections": m["sections"][:2]}, "unexpected bytes"),
    **{f"missing {key}": ((lambda m, key=key: {k: v for k, v in m.items() if k != key}),
                          f"manifest is missing key '{key}'") for key in evermind._REQUIRED_KEYS},
}


@pytest.mark.parametrize("case", MANIFEST_DEFECTS, ids=list(MANIFEST_DEFECTS))
def test_manifest_defects(package, case):
    mutate, needle = MANIFEST_DEFECTS[case]
    package.write_bytes(_repack(package.read_bytes(), mutate))
    assert needle in _load_error(package)


def test_repack_without_changes_is_valid(package):
    """The helper the defect tests use changes nothing by itself."""
    package.write_bytes(_repack(package.read_bytes(), lambda m: m))
    load(package)


def test_tokenizer_vocab_must_match_the_model(tmp_path, package, pkg_model, pkg_corpus):
    cfg, weights = pkg_model
    other = train_tokenizer([pkg_corpus], 300, progress=False)
    package.with_name("old.txt").write_bytes(b"keep me")
    with pytest.raises(MambactlError, match="the tokenizer has 300 tokens but the model's vocab_size is 320"):
        _write(package.with_name("old.txt"), cfg, weights, other)
    assert package.with_name("old.txt").read_bytes() == b"keep me"
    # A package whose tokenizer section disagrees with its config (the manifest itself consistent).
    manifest = read_manifest(package)
    pkg = load(package)
    (tmp_path / "bad.evermind").write_bytes(_assemble(manifest, [
        ("weights", "safetensors", bytes(pkg.section("weights"))),
        ("tokenizer", "tokenizer.json", other.to_str().encode())]))
    assert "the tokenizer has 300 tokens" in _load_error(tmp_path / "bad.evermind")


def test_weights_section_defects(tmp_path, package, pkg_model):
    weights = pkg_model[1]
    manifest = read_manifest(package)
    tokenizer = bytes(load(package).section("tokenizer"))
    bad_weights = {
        "missing parameter backbone.norm_f.weight": {k: v for k, v in weights.items() if k != "backbone.norm_f.weight"},
        "unexpected tensor extra": {**weights, "extra": np.zeros(3, np.float32)},
        "has shape [3]": {**weights, "backbone.norm_f.weight": np.zeros(3, np.float32)},
        "is F16 but the manifest says F32": {k: v.astype(np.float16) for k, v in weights.items()},
    }
    for needle, tensors in bad_weights.items():
        blob = safetensors.numpy.save(tensors)
        path = tmp_path / "w.evermind"
        path.write_bytes(_assemble(manifest, [("weights", "safetensors", blob),
                                              ("tokenizer", "tokenizer.json", tokenizer)]))
        assert needle in _load_error(path)


def test_write_package_validates_before_writing(tmp_path, pkg_model, pkg_tokenizer):
    cfg, weights = pkg_model
    out = tmp_path / "out.evermind"
    out.write_bytes(b"previous")
    cases = {
        "missing parameter": {k: v for k, v in weights.items() if k != "backbone.norm_f.weight"},
        "has shape": {**weights, "backbone.norm_f.weight": np.zeros(2, np.float32)},
        "expected floating point": {**weights, "backbone.norm_f.weight": np.ones(16, np.int32)},
    }
    for needle, bad in cases.items():
        with pytest.raises(MambactlError, match=needle):
            _write(out, cfg, bad, pkg_tokenizer)
    for kwargs, needle in (({"dtype": "F64"}, "dtype"), ({"name": ""}, "name"), ({"card": {"bogus": 1}}, "bogus"),
                           ({"provenance": {"steps": -1}}, "steps"),
                           ({"extra_sections": {"weights": ("raw", b"")}}, "section name")):
        with pytest.raises(MambactlError, match=needle):
            _write(out, cfg, weights, pkg_tokenizer, **kwargs)
    assert out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.evermind"]  # no temp files left


def test_source_date_epoch_must_be_an_integer(tmp_path, pkg_model, pkg_tokenizer, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(MambactlError, match="SOURCE_DATE_EPOCH"):
        _write(tmp_path / "x.evermind", *pkg_model, pkg_tokenizer)


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    out = tmp_path / "out.bin"
    out.write_bytes(b"previous")

    def chunks():
        yield b"partial"
        raise MambactlError("failed mid-write")

    with pytest.raises(MambactlError, match="mid-write"):
        atomic_write(out, chunks())
    assert out.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_directories_and_missing_files(tmp_path, pkg_model, pkg_tokenizer):
    for call in (load, read_manifest, verify, describe):
        with pytest.raises(MambactlError, match="is a directory"):
            call(tmp_path)
        with pytest.raises(MambactlError, match="no such file"):
            call(tmp_path / "missing.evermind")
    with pytest.raises(MambactlError, match="is a directory"):
        _write(tmp_path, *pkg_model, pkg_tokenizer)
    with pytest.raises(MambactlError, match="does not exist"):
        _write(tmp_path / "no" / "x.evermind", *pkg_model, pkg_tokenizer)
    (tmp_path / "empty.evermind").write_bytes(b"")
    assert "0 bytes, too short" in _load_error(tmp_path / "empty.evermind")


# version 1 ------------------------------------------------------------------------------------------------------
V1_MANIFEST = {"schema": "evermind.model/1", "name": "old", "version": "0.3", "modelType": "evermind-lm",
               "config": {"vocabSize": 260, "dModel": 8, "numLayers": 1, "convKernel": 4, "hiddenDim": 16,
                          "numExperts": 2, "topK": 1},
               "paramCount": 4242, "checkpointFormat": "EVL0", "checkpointFp16": False, "checksum": 123456,
               "card": {"description": "an old-engine package"}}


@pytest.fixture
def v1_package(tmp_path):
    """An old-engine v1 file: magic, version 1, manifest length, compact JSON, then checkpoint bytes."""
    body = json.dumps(V1_MANIFEST, separators=(",", ":")).encode()
    path = tmp_path / "old.evermind"
    path.write_bytes(struct.pack("<III", evermind.MAGIC, 1, len(body)) + body + b"EVL0" + bytes(60))
    return path


def test_v1_manifest_is_read_but_not_loaded(v1_package):
    assert read_manifest(v1_package) == V1_MANIFEST
    facts = describe(v1_package)
    assert facts["format_version"] == 1 and not facts["loadable"] and facts["manifest"] == V1_MANIFEST
    assert "'EVL0'" in facts["note"] and "cannot load" in facts["note"]
    assert "evermind v1 package" in _load_error(v1_package)
    with pytest.raises(MambactlError, match="cannot load or verify"):
        describe(v1_package, verify=True)


# fuzzing --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_files(tmp_path_factory, pkg_model, pkg_tokenizer):
    """(a valid package, a scratch path for mutated copies)."""
    directory = tmp_path_factory.mktemp("pkg_fuzz")
    _write(directory / "valid.evermind", *pkg_model, pkg_tokenizer)
    return directory / "valid.evermind", directory / "mutant.evermind"


def _must_fail_cleanly_or_load(path, changed: bool) -> None:
    """Loading never raises anything but MambactlError; a changed file never passes verification."""
    try:
        pkg = load(path, verify=False)
        assert all(np.isfinite(w).any() or w.size for w in pkg.weights.values())
    except MambactlError:
        pass
    if changed:
        with pytest.raises(MambactlError):
            load(path, verify=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=4),
       cut=st.none() | st.floats(0, 1, exclude_max=True))
def test_fuzz_reader_with_mutated_bytes(fuzz_files, edits, cut):
    valid, path = fuzz_files[0].read_bytes(), fuzz_files[1]
    data = bytearray(valid)
    for where, value in edits:
        data[int(where * len(data))] = value
    if cut is not None:
        data = data[:int(cut * len(data))]
    path.write_bytes(bytes(data))
    _must_fail_cleanly_or_load(path, bytes(data) != valid)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                           max_leaves=8)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path_in_manifest=st.lists(st.sampled_from(["sections", "config", "tokenizer", "card", "provenance",
                                                  "mamba1", "specials", 0, 1, "offset", "length", "name",
                                                  "n_layer", "vocab_size", *evermind._REQUIRED_KEYS]),
                                 min_size=1, max_size=3),
       value=JSON_VALUES)
def test_fuzz_reader_with_mutated_manifest(fuzz_files, path_in_manifest, value):
    """Manifests with any JSON value planted anywhere (and a valid digest) fail with a MambactlError."""
    valid, path = fuzz_files[0].read_bytes(), fuzz_files[1]

    def plant(m):
        node = m
        for key in path_in_manifest[:-1]:
            try:
                node = node[key]
            except (KeyError, IndexError, TypeError):
                return m
        try:
            node[path_in_manifest[-1]] = value
        except (IndexError, TypeError):
            pass
        return m

    path.write_bytes(_repack(valid, plant))
    _must_fail_cleanly_or_load(path, changed=False)


# checkpoints ----------------------------------------------------------------------------------------------------
def test_checkpoint_round_trip_and_errors(tmp_path, pkg_model):
    cfg, weights = pkg_model
    save_checkpoint_weights(tmp_path / "step-5", cfg, weights)
    step = tmp_path / "step-5"
    for args in ((step,), (step / "model.safetensors", step / "model.json")):
        loaded_cfg, loaded = load_checkpoint_weights(*args)
        assert loaded_cfg == cfg and all(np.array_equal(loaded[k], v) for k, v in weights.items())
    with pytest.raises(MambactlError, match="missing parameter"):
        save_checkpoint_weights(tmp_path / "bad", cfg, {})
    (tmp_path / "bare.safetensors").write_bytes((tmp_path / "step-5" / "model.safetensors").read_bytes())
    with pytest.raises(MambactlError, match="model.json: no such file"):
        load_checkpoint_weights(tmp_path / "bare.safetensors")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"\x00" * 20)
    (tmp_path / "junk" / "model.json").write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(MambactlError, match="not a readable safetensors file"):
        load_checkpoint_weights(tmp_path / "junk")
    (tmp_path / "junk" / "model.json").write_text(json.dumps({**cfg.to_dict(), "d_model": 32}))
    (tmp_path / "junk" / "model.safetensors").write_bytes((tmp_path / "step-5" / "model.safetensors").read_bytes())
    with pytest.raises(MambactlError, match="the config needs"):
        load_checkpoint_weights(tmp_path / "junk")


# command line ---------------------------------------------------------------------------------------------------
@pytest.fixture
def run_dir(tmp_path, pkg_model, pkg_tokenizer):
    """A training run directory: tokenizer.json, config.toml and checkpoints/step-7/ with weights and state."""
    step = tmp_path / "run" / "checkpoints" / "step-7"
    save_checkpoint_weights(step, *pkg_model)
    (step / "train_state.json").write_text(json.dumps({"step": 7, "tokens_seen": 896, "losses": {"train": 5.5}}))
    (tmp_path / "run" / "config.toml").write_text("[train]\nsteps = 7\n")
    (tmp_path / "run" / "tokenizer.json").write_text(pkg_tokenizer.to_str())
    return tmp_path / "run"


def test_cli_pack_inspect_verify(pkg_cli, run_dir, pkg_model):
    result = pkg_cli("pack", run_dir / "checkpoints" / "step-7", "-o", "tiny.evermind", "--name", "tiny",
                     "--description", "a [bold]tiny[/bold] model", "--license", "MIT", "--tag", "a", "--tag", "b")
    assert result.returncode == 0, result.stderr
    shown = pkg_cli("inspect", "tiny.evermind")
    assert shown.returncode == 0, shown.stderr
    for text in ("tiny", "a [bold]tiny[/bold] model", "mixer.in_proj.weight", "<|endoftext|> (0)", "weights",
                 "not checked"):
        assert text in shown.stdout, text
    facts = json.loads(pkg_cli("inspect", "tiny.evermind", "--json").stdout)
    assert facts["manifest"]["card"]["tags"] == ["a", "b"]
    assert facts["manifest"]["provenance"] == {"mambactl_version": "0.1.0", "training_config": "[train]\nsteps = 7\n",
                                               "steps": 7, "tokens_seen": 896, "final_losses": {"train": 5.5}}
    assert len(facts["parameters"]) == len(pkg_model[1])
    checked = pkg_cli("inspect", "tiny.evermind", "--verify")
    assert checked.returncode == 0 and "every section's SHA-256 matches" in checked.stdout


def test_cli_pack_bare_safetensors(pkg_cli, run_dir, tmp_path, pkg_model):
    step = run_dir / "checkpoints" / "step-7"
    result = pkg_cli("pack", step / "model.safetensors", "--config", step / "model.json",
                     "--tokenizer", run_dir / "tokenizer.json", "-o", "bare.evermind", "--dtype", "f16")
    assert result.returncode == 0, result.stderr
    pkg = load(tmp_path / "bare.evermind")
    assert pkg.manifest["dtype"] == "F16" and pkg.config == pkg_model[0]


def test_cli_pack_refuses_a_mismatched_tokenizer(pkg_cli, pkg_one_line_error, run_dir, tmp_path, pkg_corpus):
    (tmp_path / "out.evermind").write_bytes(b"previous")
    train = pkg_cli("tokenizer", "train", pkg_corpus, "--vocab-size", 300, "-o", "small.json", "--no-progress")
    assert train.returncode == 0, train.stderr
    result = pkg_cli("pack", run_dir / "checkpoints" / "step-7", "--tokenizer", "small.json", "-o", "out.evermind")
    pkg_one_line_error(result, "the tokenizer has 300 tokens but the model's vocab_size is 320")
    assert (tmp_path / "out.evermind").read_bytes() == b"previous"


def test_cli_inspect_errors(pkg_cli, pkg_one_line_error, package, v1_package, tmp_path):
    pkg_one_line_error(pkg_cli("inspect", tmp_path), "is a directory")
    (tmp_path / "x.evermind").write_bytes(b"PK\x03\x04" + bytes(60))
    pkg_one_line_error(pkg_cli("inspect", "x.evermind"), "not an .evermind package")
    weights = _sections(package)["weights"]
    data = bytearray(package.read_bytes())
    data[weights["offset"] + weights["length"] - 1] ^= 0x01
    package.write_bytes(bytes(data))
    assert pkg_cli("inspect", package).returncode == 0
    pkg_one_line_error(pkg_cli("inspect", package, "--verify"), "section 'weights' is corrupt")
    old = pkg_cli("inspect", v1_package)
    assert old.returncode == 0 and "EVL0" in old.stdout and "cannot load" in old.stdout
    pkg_one_line_error(pkg_cli("inspect", v1_package, "--verify"), "evermind v1 package")
