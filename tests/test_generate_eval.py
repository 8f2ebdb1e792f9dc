"""Using a package: sampling, streamed generation, and evaluation that agrees with transformers."""

import json

import numpy as np
import pytest

from lm_checks import random_weights
from mambactl.evaluate import evaluate_tokens
from mambactl.generate import generate, sample_next
from mambactl.models.config import AttentionConfig, Mamba2Config, ModelConfig
from mambactl.models.lm import LanguageModel
from mambactl.package import load, write_package
from mambactl.package.tokenizer import vocab_size
from mambactl.runtime.gpu import get_runtime

TEXT = "def add(a, b):\n    return a + b  # sums ünïcödé 🙂\n"


@pytest.fixture(scope="module")
def package(tmp_path_factory, pkg_tokenizer, pkg_model):
    cfg, weights = pkg_model
    rng = np.random.default_rng(0)
    weights = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in weights.items()}
    path = tmp_path_factory.mktemp("gen") / "m.evermind"
    write_package(path, cfg, weights, pkg_tokenizer, name="t", version="1")
    return path


@pytest.fixture(scope="module")
def lm(package):
    pkg = load(package)
    return pkg, LanguageModel(pkg.config, get_runtime(), pkg.weights)


def test_sampling_rules():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 3.0, 1.0, 2.9])
    assert sample_next(logits, rng, 0.0, 0, 1.0) == 1  # greedy
    assert sample_next(logits, rng, 1.0, 1, 1.0) == 1  # top-1 is greedy at any temperature
    assert {sample_next(logits, rng, 5.0, 2, 1.0) for _ in range(200)} == {1, 3}  # top-k keeps two
    assert {sample_next(logits, rng, 1.0, 0, 0.3) for _ in range(50)} == {1}  # the nucleus holds one token
    assert len({sample_next(logits, rng, 100.0, 0, 1.0) for _ in range(400)}) == 4


def assert_greedy_follows_the_parallel_forward(model, tokenizer, prompt, max_tokens):
    result = generate(model, tokenizer, prompt, max_tokens=max_tokens, temperature=0.0)
    ids = tokenizer.encode(prompt).ids
    for tok in result.tokens:  # each token is the argmax of the parallel forward over what came before
        _, logits, _ = model.forward(np.array([ids]))
        assert tok == int(np.argmax(logits.numpy()[-1, : model.cfg.vocab_size]))
        ids.append(tok)
    assert result.decode_tokens_per_s > 0


def test_greedy_generation_follows_the_parallel_forward(lm):
    pkg, model = lm
    assert_greedy_follows_the_parallel_forward(model, pkg.tokenizer, "def ", 6)


def test_hybrid_with_attention_generates_recurrently(pkg_tokenizer):
    """Attention layers decode through their KV cache inside a hybrid, like the Mamba layers."""
    cfg = ModelConfig(vocab_size=vocab_size(pkg_tokenizer), d_model=16, n_layer=3,
                      layers=["mamba1", "attention", "mamba2"], attention=AttentionConfig(n_heads=2),
                      mamba2=Mamba2Config(d_state=4, headdim=8, chunk_size=4))
    model = LanguageModel(cfg, get_runtime(), random_weights(cfg, 0))
    assert_greedy_follows_the_parallel_forward(model, pkg_tokenizer, "x = ", 8)


def test_same_seed_same_text_and_streaming(lm):
    pkg, model = lm
    pieces = []
    a = generate(model, pkg.tokenizer, "x = ", max_tokens=12, seed=7, on_text=pieces.append)
    b = generate(model, pkg.tokenizer, "x = ", max_tokens=12, seed=7)
    assert a.tokens == b.tokens and a.text == b.text == "".join(pieces)
    assert generate(model, pkg.tokenizer, "x = ", max_tokens=12, seed=8, temperature=2.0).tokens != a.tokens


def test_stop_string_empty_prompt_and_long_prompt(lm):
    pkg, model = lm
    free = generate(model, pkg.tokenizer, "", max_tokens=10, temperature=0.0)
    assert free.prompt_tokens == 1 and len(free.tokens) <= 10
    if free.text.strip():
        stop = free.text.strip()[0]
        cut = generate(model, pkg.tokenizer, "", max_tokens=10, temperature=0.0, stop=[stop])
        assert stop not in cut.text and cut.stopped_by == "stop"
    long_prompt = TEXT * 60  # far beyond the training length; the parallel prefill takes any length
    result = generate(model, pkg.tokenizer, long_prompt, max_tokens=3, temperature=0.0)
    assert result.prompt_tokens > 1000 and len(result.tokens) == 3


def test_eval_windows_cover_every_prediction_once(lm):
    pkg, model = lm
    ids = np.array(pkg.tokenizer.encode(TEXT * 3).ids)
    whole = evaluate_tokens(model, [ids], window=len(ids))
    pieces = evaluate_tokens(model, [ids], window=7)
    assert whole["tokens"] == pieces["tokens"] == len(ids) - 1
    assert pieces["loss"] > whole["loss"] - 1e-6 or abs(pieces["loss"] - whole["loss"]) < 0.5
    assert 0 <= whole["top1"] <= whole["top5"] <= 1
    assert whole["bits_per_token"] == pytest.approx(whole["loss"] / np.log(2))


def test_eval_loss_equals_transformers(lm, package, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from mambactl.interop.hf import export_hf

    pkg, model = lm
    export_hf(pkg, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    ids = pkg.tokenizer.encode(TEXT).ids
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    got = evaluate_tokens(model, [np.array(ids)], window=1024)
    assert abs(got["loss"] - want) / want < 1e-4


def test_cli_generate_and_eval(package, pkg_cli, tmp_path):
    r = pkg_cli("generate", package, "--prompt", "def ", "-n", "5", "--temperature", "0")
    assert r.returncode == 0 and r.stdout.startswith("def ") and "tokens/s decode" in r.stderr
    data = tmp_path / "t.txt"
    data.write_text(TEXT)
    r = pkg_cli("eval", package, data, "--json")
    assert r.returncode == 0
    out = json.loads(r.stdout)
    assert set(out) == {"loss", "perplexity", "bits_per_token", "top1", "top5", "tokens"}
    r = pkg_cli("eval", package, tmp_path / "missing.txt")
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
