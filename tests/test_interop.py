"""Import from transformers / mamba_ssm directories, export to transformers and GGUF: logits, files, bad inputs, CLI.

torch, transformers and gguf are test-only oracles (`pytest.importorskip` per test); the bad-input tests build
their directories with mambactl's own exporter and need none of them.
"""

import json
import logging
import pickle
import re
import zipfile
from contextlib import contextmanager

import numpy as np
import pytest
import safetensors.numpy
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mambactl.errors import MambactlError
from mambactl.interop import export_gguf, export_hf, import_checkpoint
from mambactl.interop.gguf import gguf_tensors
from mambactl.interop.mamba_ssm import read_torch_checkpoint
from mambactl.models.config import ModelConfig
from mambactl.models.params import init_parameters
from mambactl.package import load, write_package
from mambactl.package.tokenizer import encode
from mambactl.reference.lm import BLOCKS, lm_forward

TOKENS = 301  # not a multiple of 8: the stored embedding is padded to 304 rows
ROWS = 304
KINDS = ["mamba1"] + (["mamba2"] if "mamba2" in BLOCKS else [])  # Mamba-2 once the reference has it
# Small mixers: Mamba-1 d_inner 32, dt_rank 3; Mamba-2 d_inner 32, 4 heads of 8, 2 groups, chunks of 4.
MIXERS = {"mamba1": {"d_state": 4, "d_conv": 3, "dt_rank": 3},
          "mamba2": {"d_state": 8, "d_conv": 3, "headdim": 8, "ngroups": 2, "chunk_size": 4}}
IDS = np.array([[5, 17, 300, 2, 99, 150, 7, 42, 0, 260], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
SAMPLE = "The quick brown fox — 12345 <|endoftext|> def f(x):\n\treturn x"


# fixtures -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(pkg_corpus):
    """A GPT-2 style byte-level BPE made with the tokenizers library: 301 tokens, specials 0 and 1."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENS, special_tokens=["<|endoftext|>", "<|padding|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t.train([str(pkg_corpus)], trainer)
    assert t.get_vocab_size() == TOKENS
    return t


def model_config(kind, **mixer):
    return ModelConfig.from_dict({"vocab_size": TOKENS, "d_model": 16, "n_layer": 2, "layers": [kind] * 2,
                                  "pad_vocab_size_multiple": 8, kind: MIXERS[kind] | mixer})


def make_package(path, tok, kind, seed=0, **mixer):
    """A package of random weights (every tensor perturbed, so no parameter is trivially 0 or 1)."""
    cfg = model_config(kind, **mixer)
    rng = np.random.default_rng(seed)
    weights = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32)
               for k, v in init_parameters(cfg, seed).items()}
    write_package(path, cfg, weights, tok, name="tiny", version="1.0")
    return load(path)


@pytest.fixture(scope="module", params=KINDS)
def package(request, tmp_path_factory, tok):
    return make_package(tmp_path_factory.mktemp("pkg") / "tiny.evermind", tok, request.param)


def ours(pkg, ids=IDS):
    """Logits [B, L, V_padded] of mambactl's float64 reference."""
    params = {k: v.astype(np.float64) for k, v in pkg.weights.items()}
    return lm_forward(params, pkg.config, ids)[0]


# transformers oracles -------------------------------------------------------------------------------------------
def hf_model(kind, seed=0):
    """A random float32 MambaForCausalLM / Mamba2ForCausalLM with ROWS embedding rows, every tensor perturbed."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    m = MIXERS[kind]
    common = {"vocab_size": ROWS, "hidden_size": 16, "num_hidden_layers": 2, "state_size": m["d_state"],
              "conv_kernel": m["d_conv"], "expand": 2, "use_cache": False, "tie_word_embeddings": True}
    if kind == "mamba1":
        config = transformers.MambaConfig(**common, time_step_rank=m["dt_rank"], use_bias=True)
        model_class = transformers.MambaForCausalLM
    else:
        config = transformers.Mamba2Config(**common, head_dim=m["headdim"], num_heads=4, n_groups=m["ngroups"],
                                           chunk_size=m["chunk_size"])
        model_class = transformers.Mamba2ForCausalLM
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def skip_unless_hf_oracle(kind):
    """The Mamba-2 mixers here have ngroups 2: skip where the installed transformers computes another function."""
    if kind == "mamba2":
        pytest.importorskip("torch")
        from hf_parity import skip_unless_hf_groups_gated_norm

        skip_unless_hf_groups_gated_norm(MIXERS["mamba2"]["ngroups"])


def hf_logits(model, ids=IDS):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)).logits.double().numpy()


@contextmanager
def transformers_warnings():
    """Collect every WARNING+ record of transformers' loggers (its load report included)."""
    records = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def weight_complaints(records):
    """Messages that report missing, unexpected, mismatched or newly initialised weights."""
    pattern = re.compile(r"missing|unexpected|mismatch|newly initiali[sz]ed|not used", re.IGNORECASE)
    return [r.getMessage() for r in records if pattern.search(r.getMessage())]


# import ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_import_transformers_checkpoint_gives_its_logits(tmp_path, tok, kind):
    skip_unless_hf_oracle(kind)
    model = hf_model(kind)
    model.save_pretrained(tmp_path / "hf")
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    manifest = import_checkpoint(tmp_path / "hf", tmp_path / "m.evermind")
    pkg = load(tmp_path / "m.evermind")
    assert manifest["config"]["vocab_size"] == TOKENS and pkg.config.padded_vocab_size == ROWS
    assert manifest["name"] == "hf" and "imported" in manifest["card"]["tags"]
    assert np.abs(ours(pkg) - hf_logits(model)).max() < 1e-4
    if kind == "mamba1":  # the model was made with use_bias = True: in_proj / out_proj biases came along
        assert pkg.config.mamba1.bias and "backbone.layers.0.mixer.in_proj.bias" in pkg.weights


@pytest.mark.parametrize("kind", KINDS)
def test_import_mamba_ssm_directory(tmp_path, tok, kind):
    """config.json with d_model / n_layer / ssm_cfg, pytorch_model.bin with `backbone.embedding.weight` and the
    tied lm_head.weight sharing its storage, read without unpickling code; no tokenizer in the directory."""
    torch = pytest.importorskip("torch")
    skip_unless_hf_oracle(kind)
    model = hf_model(kind)
    src = tmp_path / "mamba_ssm"
    src.mkdir()
    state = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in model.state_dict().items()}
    assert state["lm_head.weight"].data_ptr() == state["backbone.embedding.weight"].data_ptr()
    torch.save(state, src / "pytorch_model.bin")
    ssm_cfg = {k: v for k, v in MIXERS[kind].items()} | ({"bias": True} if kind == "mamba1" else {"layer": "Mamba2"})
    config = {"d_model": 16, "d_intermediate": 0, "n_layer": 2, "vocab_size": TOKENS, "ssm_cfg": ssm_cfg,
              "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
              "fused_add_norm": True, "pad_vocab_size_multiple": 8 if kind == "mamba1" else 16,
              "tie_embeddings": True}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(MambactlError, match="no tokenizer.json; pass --tokenizer"):
        import_checkpoint(src, tmp_path / "m.evermind")
    tok.save(str(tmp_path / "tokenizer.json"))
    import_checkpoint(src, tmp_path / "m.evermind", tokenizer=tmp_path / "tokenizer.json", name="ssm")
    pkg = load(tmp_path / "m.evermind")
    assert pkg.config.padded_vocab_size == ROWS and pkg.config.layers == [kind] * 2
    assert np.abs(ours(pkg) - hf_logits(model)).max() < 1e-4


def test_torch_reader_matches_torch(tmp_path):
    """Every float dtype, views (transposed, offset slices of a shared storage) and nn.Parameter."""
    torch = pytest.importorskip("torch")
    base = torch.randn(5, 6, dtype=torch.float64)
    state = {"f32": base.float(), "t": base.float().t(), "row": base.float()[2], "col": base.float()[:, 3],
             "f16": base.half(), "bf16": base.bfloat16(), "f64": base, "param": torch.nn.Parameter(base[1:3].float()),
             "empty": torch.zeros(0, 4)}
    torch.save(state, tmp_path / "w.bin")
    got = read_torch_checkpoint(tmp_path / "w.bin")
    assert set(got) == set(state)
    for name, t in state.items():
        assert got[name].dtype == np.float32 and got[name].shape == tuple(t.shape)
        np.testing.assert_array_equal(got[name], t.detach().float().numpy(), err_msg=name)


class _Boom:
    def __reduce__(self):
        import os

        return os.system, ("echo pwned > pwned.txt",)


def test_torch_reader_refuses_code_and_legacy_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with zipfile.ZipFile(tmp_path / "evil.bin", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": _Boom()}, protocol=2))
    with pytest.raises(MambactlError, match=r"refers to (posix|nt|os)\.system.*refusing"):
        read_torch_checkpoint(tmp_path / "evil.bin")
    assert not (tmp_path / "pwned.txt").exists()
    (tmp_path / "legacy.bin").write_bytes(pickle.dumps({"w": 1}))
    with pytest.raises(MambactlError, match="not a zip-format torch checkpoint"):
        read_torch_checkpoint(tmp_path / "legacy.bin")


# export: transformers -------------------------------------------------------------------------------------------
def test_export_hf_loads_in_transformers_with_the_same_logits(tmp_path, package, tok):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    skip_unless_hf_oracle(package.config.layers[0])
    files = export_hf(package, tmp_path / "hf")
    assert {f.name for f in files} >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == {"mamba1": "mamba", "mamba2": "mamba2"}[package.config.layers[0]]
    assert config["vocab_size"] == ROWS and config["tie_word_embeddings"] is True
    with transformers_warnings() as records:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
        hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert weight_complaints(records) == []
    assert np.abs(hf_logits(model.eval()) - ours(package)).max() < 1e-4
    assert hf_tok(SAMPLE)["input_ids"] == encode(tok, SAMPLE)
    assert hf_tok.decode(encode(tok, SAMPLE)) == SAMPLE
    assert (hf_tok.eos_token, hf_tok.pad_token_id) == ("<|endoftext|>", 1)
    # the log check sees a broken directory: drop a tensor, add a stray one
    weights = safetensors.numpy.load_file(tmp_path / "hf" / "model.safetensors")
    weights["stray.weight"] = weights.pop("backbone.layers.1.mixer.D")
    safetensors.numpy.save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with transformers_warnings() as records:
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert weight_complaints(records)


def test_export_hf_then_import_round_trips(tmp_path, package):
    export_hf(package, tmp_path / "hf")
    import_checkpoint(tmp_path / "hf", tmp_path / "back.evermind")
    back = load(tmp_path / "back.evermind")
    assert back.config.layers == package.config.layers and back.config.padded_vocab_size == ROWS
    assert back.tokenizer.to_str() == package.tokenizer.to_str()
    for name, value in package.weights.items():
        np.testing.assert_array_equal(back.weights[name], value, err_msg=name)


def _bf16_safetensors(tensors):
    """safetensors bytes of float32 arrays stored as BF16 (truncated), written by hand: numpy has no bfloat16."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        blob = (np.ascontiguousarray(array, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def test_import_sharded_f16_and_bf16_safetensors(tmp_path, package):
    """model.safetensors.index.json naming two shards, one F16 and one BF16: values widen exactly."""
    export_hf(package, tmp_path / "hf")
    weights = safetensors.numpy.load_file(tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "model.safetensors").unlink()
    names = sorted(weights)
    half, bf16 = names[: len(names) // 2], names[len(names) // 2:]
    safetensors.numpy.save_file({n: weights[n].astype(np.float16) for n in half},
                                tmp_path / "hf" / "model-00001-of-00002.safetensors")
    (tmp_path / "hf" / "model-00002-of-00002.safetensors").write_bytes(_bf16_safetensors({n: weights[n] for n in bf16}))
    weight_map = {n: f"model-0000{1 + (n in bf16)}-of-00002.safetensors" for n in names}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    import_checkpoint(tmp_path / "hf", tmp_path / "back.evermind")
    back = load(tmp_path / "back.evermind").weights
    for n in half:
        np.testing.assert_array_equal(back[n], weights[n].astype(np.float16).astype(np.float32), err_msg=n)
    for n in bf16:
        truncated = (weights[n].view(np.uint32) & 0xFFFF0000).view(np.float32)
        np.testing.assert_array_equal(back[n], truncated, err_msg=n)


# export: GGUF ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_export_gguf_reads_back(tmp_path, package, tok, dtype):
    gguf = pytest.importorskip("gguf")
    facts = export_gguf(package, tmp_path / "m.gguf", dtype)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items()}
    cfg, kind = package.config, package.config.layers[0]
    arch = {"mamba1": "mamba", "mamba2": "mamba2"}[kind]
    assert fields["GGUF.version"] == 3 and fields["general.architecture"] == arch == facts["architecture"]
    assert fields["general.file_type"] == {"f32": 0, "f16": 1}[dtype] and fields["general.name"] == "tiny"
    inner = 32
    expected = {"context_length": 2 ** 20, "embedding_length": 16, "block_count": 2, "feed_forward_length": 0,
                "attention.head_count": 0, "ssm.conv_kernel": 3, "ssm.inner_size": inner,
                "ssm.state_size": MIXERS[kind]["d_state"],
                "ssm.time_step_rank": 3 if kind == "mamba1" else cfg.mamba2_nheads}
    expected |= {"ssm.dt_b_c_rms": False} if kind == "mamba1" else {"ssm.group_count": 2}
    for key, value in expected.items():
        assert fields[f"{arch}.{key}"] == value, key
    assert fields[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    # tokenizer: byte-level strings by id, padded to the embedding rows
    vocab = tok.get_vocab()
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == ROWS and all(tokens[i] == t for t, i in vocab.items())
    assert tokens[TOKENS:] == [f"[PAD{i}]" for i in range(TOKENS, ROWS)]
    types = fields["tokenizer.ggml.token_type"]
    assert types[:2] == [3, 3] and set(types[2:TOKENS]) == {1} and set(types[TOKENS:]) == {5}
    merges = json.loads(tok.to_str())["model"]["merges"]
    assert fields["tokenizer.ggml.merges"] == [" ".join(m) if isinstance(m, list) else m for m in merges]
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"],
            fields["tokenizer.ggml.padding_token_id"]) == (0, 0, 1)
    # tensors: names, GGUF dims (numpy shape reversed), types and values
    w = package.weights
    tensors = {t.name: t for t in reader.tensors}
    p = "backbone.layers.1.mixer."
    want = {"token_embd.weight": w["backbone.embeddings.weight"], "output_norm.weight": w["backbone.norm_f.weight"],
            "blk.1.attn_norm.weight": w["backbone.layers.1.norm.weight"],
            "blk.1.ssm_in.weight": w[p + "in_proj.weight"], "blk.1.ssm_out.weight": w[p + "out_proj.weight"],
            "blk.1.ssm_conv1d.weight": w[p + "conv1d.weight"][:, 0, :], "blk.1.ssm_conv1d.bias": w[p + "conv1d.bias"]}
    if kind == "mamba1":
        want |= {"blk.1.ssm_x.weight": w[p + "x_proj.weight"], "blk.1.ssm_dt.weight": w[p + "dt_proj.weight"],
                 "blk.1.ssm_dt.bias": w[p + "dt_proj.bias"], "blk.1.ssm_a": -np.exp(w[p + "A_log"]),
                 "blk.1.ssm_d": w[p + "D"]}
    else:
        want |= {"blk.1.ssm_dt.bias": w[p + "dt_bias"], "blk.1.ssm_a": -np.exp(w[p + "A_log"])[:, None],
                 "blk.1.ssm_d": w[p + "D"][:, None], "blk.1.ssm_norm.weight": w[p + "norm.weight"].reshape(2, 16)}
    count = {"mamba1": 2 + 2 * 10, "mamba2": 2 + 2 * 9}[kind]  # embd, output_norm; per layer
    assert len(tensors) == count == facts["tensors"] and "output.weight" not in tensors
    matrices = {"token_embd.weight", "blk.1.ssm_in.weight", "blk.1.ssm_x.weight", "blk.1.ssm_dt.weight",
                "blk.1.ssm_out.weight"}
    for name, value in want.items():
        t = tensors[name]
        assert list(t.shape) == list(value.shape[::-1]), name
        half = dtype == "f16" and name in matrices
        assert int(t.tensor_type) == (1 if half else 0), name
        np.testing.assert_array_equal(np.asarray(t.data), value.astype(np.float16 if half else np.float32),
                                      err_msg=name)


def test_gguf_layout_rules(tok):
    """No conv bias -> zeros (llama.cpp requires one); expand != 2 and in/out biases are refused."""
    cfg = model_config("mamba1", conv_bias=False)
    names = dict(gguf_tensors(cfg, init_parameters(cfg)))
    assert not names["blk.0.ssm_conv1d.bias"].any() and names["blk.0.ssm_conv1d.bias"].shape == (32,)
    for mixer, needle in (({"expand": 3}, "expand = 2 only"), ({"bias": True}, "no in_proj/out_proj bias")):
        cfg = model_config("mamba1", **mixer)
        with pytest.raises(MambactlError, match=needle):
            gguf_tensors(cfg, init_parameters(cfg))


# bad inputs -----------------------------------------------------------------------------------------------------
def _edit_weights(directory, edit):
    path = directory / "model.safetensors"
    weights = safetensors.numpy.load_file(path)
    edit(weights)
    safetensors.numpy.save_file(weights, path, metadata={"format": "pt"})


def _edit_config(directory, edit):
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))


A_LOG, CONV = "backbone.layers.1.mixer.A_log", "backbone.layers.0.mixer.conv1d.weight"
BAD = {
    "unsupported_architecture": (
        lambda d: _edit_config(d, lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"])),
        ["config.json: unsupported architecture 'LlamaForCausalLM'", "MambaForCausalLM"]),
    "missing_tensor": (lambda d: _edit_weights(d, lambda w: w.pop(A_LOG)),
                       [f"missing tensor {A_LOG} (expected shape [32, 4])"]),
    "shape_mismatch": (lambda d: _edit_weights(d, lambda w: w.update({CONV: np.zeros((32, 1, 4), np.float32)})),
                       [f"tensor {CONV} has shape [32, 1, 4]; expected [32, 1, 3]"]),
    "unexpected_tensor": (lambda d: _edit_weights(d, lambda w: w.update({"backbone.extra.weight": np.zeros(2)})),
                          ["unexpected tensor backbone.extra.weight"]),
    "untied_head": (lambda d: _edit_weights(d, lambda w: w.update({"lm_head.weight": np.ones((ROWS, 16))})),
                    ["lm_head.weight differs from backbone.embeddings.weight"]),
    "embedding_smaller_than_tokenizer": (
        lambda d: (_edit_config(d, lambda c: c.update(vocab_size=296)),
                   _edit_weights(d, lambda w: w.update({"backbone.embeddings.weight":
                                                        w["backbone.embeddings.weight"][:296]}))),
        ["the tokenizer has 301 tokens but backbone.embeddings.weight has 296 rows"]),
    "bad_config_value": (lambda d: _edit_config(d, lambda c: c.update(state_size="four")),
                         ["config.json: state_size must be a positive integer"]),
    "no_weights": (lambda d: (d / "model.safetensors").unlink(), ["no model.safetensors or pytorch_model.bin"]),
}


@pytest.fixture
def mamba1_dir(tmp_path, tok):
    pkg = make_package(tmp_path / "src.evermind", tok, "mamba1")
    export_hf(pkg, tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.parametrize("case", list(BAD))
def test_bad_source_directories_give_one_line_naming_the_problem(mamba1_dir, case):
    breaks, needles = BAD[case]
    breaks(mamba1_dir)
    with pytest.raises(MambactlError) as err:
        import_checkpoint(mamba1_dir, mamba1_dir.parent / "out.evermind")
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(mamba1_dir)), message
    for needle in needles:
        assert needle in message, (needle, message)
    assert not (mamba1_dir.parent / "out.evermind").exists()


def test_unsupported_mamba_ssm_layer_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 16, "n_layer": 2, "vocab_size": 300,
                                                      "ssm_cfg": {"layer": "Hyena"}}))
    with pytest.raises(MambactlError, match="unsupported architecture: ssm_cfg.layer = 'Hyena'"):
        import_checkpoint(tmp_path, tmp_path / "out.evermind")


def test_export_refuses_a_model_mixing_layer_types(tmp_path, tok):
    if "mamba2" not in KINDS:
        pytest.skip("needs Mamba-2")
    cfg = ModelConfig.from_dict({"vocab_size": TOKENS, "d_model": 16, "n_layer": 2, "layers": ["mamba1", "mamba2"],
                                 "mamba1": MIXERS["mamba1"], "mamba2": MIXERS["mamba2"]})
    write_package(tmp_path / "mix.evermind", cfg, init_parameters(cfg), tok, name="mix", version="1")
    pkg = load(tmp_path / "mix.evermind")
    for export, target in ((export_hf, "transformers"), (export_gguf, "GGUF")):
        with pytest.raises(MambactlError, match=f"{target} has no model mixing layer types"):
            export(pkg, tmp_path / "out")


# CLI ------------------------------------------------------------------------------------------------------------
def test_cli_import_export(tmp_path, mamba1_dir, pkg_cli, pkg_one_line_error):
    result = pkg_cli("import", mamba1_dir, "-o", tmp_path / "m.evermind", "--name", "cli")
    assert result.returncode == 0, result.stderr
    assert load(tmp_path / "m.evermind").manifest["name"] == "cli"
    result = pkg_cli("export", tmp_path / "m.evermind", "--format", "gguf", "--dtype", "f16", "-o", tmp_path / "m.gguf")
    assert result.returncode == 0 and "GGUF v3, mamba, 22 tensors, F16" in result.stdout, result.stderr
    result = pkg_cli("export", tmp_path / "m.evermind", "--format", "onnx", "-o", tmp_path / "x")
    pkg_one_line_error(result, "--format 'onnx' is not one of hf, gguf")
    _edit_weights(mamba1_dir, lambda w: w.pop(A_LOG))
    result = pkg_cli("import", mamba1_dir, "-o", tmp_path / "bad.evermind")
    pkg_one_line_error(result, f"missing tensor {A_LOG}", "expected shape [32, 4]")
