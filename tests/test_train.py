"""The trainer end to end on the software adapter: loss falls, the package verifies, resume is exact,
a NaN gradient never reaches a weight, and the CLI reports bad configs in one line."""

import json
import subprocess
import sys

import numpy as np
import pytest

from mambactl.models.config import Mamba1Config, ModelConfig
from mambactl.models.lm import LanguageModel
from mambactl.models.params import init_parameters, parameter_specs
from mambactl.ops.adamw import AdamWState, adamw_step
from mambactl.package import evermind
from mambactl.runtime.gpu import get_runtime
from mambactl.train.checkpoint import checkpoint_dirs, load_checkpoint
from mambactl.train.config import parse_config
from mambactl.train.loop import train

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))

CONFIG = """
[model]
d_model = 16
n_layer = 1
[model.mamba1]
d_state = 4
[data]
paths = ["{data}"]
val_fraction = 0.1
cache_dir = "{cache}"
[tokenizer]
vocab_size = 300
[optim]
lr = 1e-2
weight_decay = 0.01
[schedule]
kind = "{schedule}"
warmup_steps = {warmup}
[train]
batch_size = 4
seq_len = 16
steps = {steps}
eval_every = {eval_every}
eval_batches = 2
checkpoint_every = 10
keep_checkpoints = 2
log_every = 5
out_dir = "{out}"
[package]
name = "test-model"
"""


def make_config(tmp_path, name, steps, schedule="cosine", warmup=3, eval_every=10, precision="fp32"):
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    text = CONFIG.format(data=data, cache=tmp_path / "cache", out=tmp_path / name, steps=steps,
                         schedule=schedule, warmup=warmup, eval_every=eval_every)
    text = text.replace("[train]\n", f'[train]\nmatmul_precision = "{precision}"\n')
    return parse_config(text, "test")


def test_training_lowers_validation_loss_and_writes_a_verified_package(tmp_path):
    result = train(make_config(tmp_path, "run", steps=30), quiet=True)
    evals = [m for m in result.metrics if m["event"] == "eval"]
    assert [e["step"] for e in evals] == [10, 20, 30]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.3
    assert evals[-1]["val_loss"] < np.log(300) - 1.0  # well below a uniform guess
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("train_loss" in x for x in lines) and any("val_loss" in x for x in lines)
    assert all("step" in x for x in lines)
    pkg = evermind.load(result.package, verify=True)
    assert pkg.manifest["provenance"]["steps"] == 30
    assert pkg.config.d_model == 16
    for name in ("config.toml", "tokenizer.json"):
        assert (result.run_dir / name).is_file()
    assert [p.name for p in checkpoint_dirs(result.run_dir)] == ["step-20", "step-30"]  # keep_checkpoints = 2


@pytest.mark.skipif("shader-f16" not in get_runtime().features, reason="the adapter lacks shader-f16")
def test_f16_matmuls_train_like_fp32(tmp_path):
    """[train] matmul_precision = "f16" (same data, seed and steps as fp32): the validation loss falls as far as
    the fp32 run's test above asks, and stays within 0.1 nats of the fp32 run at every evaluation."""
    evals = {}
    for precision in ("fp32", "f16"):
        result = train(make_config(tmp_path, precision, steps=30, precision=precision), quiet=True)
        evals[precision] = [m["val_loss"] for m in result.metrics if m["event"] == "eval"]
    assert get_runtime().matmul_precision == "fp32"  # restored after the run
    f16, fp32 = evals["f16"], evals["fp32"]
    assert len(f16) == len(fp32) == 3
    assert f16[-1] < f16[0] - 0.3 and f16[-1] < np.log(300) - 1.0
    assert max(abs(a - b) for a, b in zip(f16, fp32)) < 0.1, (f16, fp32)


def test_resume_gives_bitwise_the_same_weights(tmp_path):
    straight = train(make_config(tmp_path, "straight", steps=20, schedule="constant", warmup=0, eval_every=0), quiet=True)
    train(make_config(tmp_path, "resumed", steps=10, schedule="constant", warmup=0, eval_every=0), quiet=True)
    resumed = train(make_config(tmp_path, "resumed", steps=20, schedule="constant", warmup=0, eval_every=0),
                    resume=True, quiet=True)
    _, w_straight, opt_straight, _ = load_checkpoint(straight.run_dir / "checkpoints" / "step-20")
    _, w_resumed, opt_resumed, state = load_checkpoint(resumed.run_dir / "checkpoints" / "step-20")
    assert state["step"] == 20
    for k in w_straight:
        np.testing.assert_array_equal(w_straight[k], w_resumed[k], err_msg=k)
    for k in opt_straight:
        np.testing.assert_array_equal(opt_straight[k], opt_resumed[k], err_msg=k)


def test_a_nan_gradient_never_reaches_a_weight_and_training_continues():
    rt = get_runtime()
    cfg = ModelConfig(vocab_size=40, d_model=8, n_layer=1, mamba1=Mamba1Config(d_state=3))
    lm = LanguageModel(cfg, rt, init_parameters(cfg, 0))
    specs = parameter_specs(cfg)
    params = [lm.params[s.name] for s in specs]
    grads = [lm.grads[s.name] for s in specs]
    opt = AdamWState.zeros(params)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 40, (2, 9))
    targets = rng.integers(0, 40, (2, 9))

    def step(poison: bool):
        lm.zero_grad()
        _, _, saved = lm.forward(ids, targets)
        lm.backward(saved)
        if poison:
            g = lm.grads["backbone.layers.0.mixer.x_proj.weight"]
            bad = g.numpy()
            bad[1, 2] = np.nan
            rt.write(g, bad)
        adamw_step(params, grads, opt, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)
        rt.flush()

    step(False)
    before = lm.weights_numpy()
    step(True)
    after = lm.weights_numpy()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)
    counters = opt.read_counters()
    assert counters["skipped_steps"] == 1 and counters["step"] == 1
    step(False)
    assert opt.read_counters()["step"] == 2
    assert any(not np.array_equal(after[k], v) for k, v in lm.weights_numpy().items())


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "mambactl", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_bad_config_is_one_line_naming_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nbatch_size = 0\n")
    r = cli("train", str(bad))
    assert r.returncode == 1
    assert "train.batch_size" in r.stderr and str(bad) in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("train", "--set", "optim.nope=1")
    assert r.returncode == 1 and "optim.nope" in r.stderr and "Traceback" not in r.stderr
    r = cli("train", str(tmp_path / "missing.toml"))
    assert r.returncode == 1 and "no such config file" in r.stderr
    r = cli("train", "--resume", "--out", str(tmp_path / "empty"))
    assert r.returncode == 1 and "no checkpoint" in r.stderr


def test_plot_writes_a_png_and_reports_missing_metrics(tmp_path):
    pytest.importorskip("matplotlib")
    from mambactl.errors import MambactlError
    from mambactl.train.plot import plot_run

    run = tmp_path / "run"
    run.mkdir()
    events = [{"event": "train", "step": s, "train_loss": 5.0 / s} for s in (1, 2, 3)]
    events.append({"event": "eval", "step": 3, "val_loss": 2.0})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(e) for e in events))
    out = plot_run(run)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(MambactlError, match="no such file"):
        plot_run(tmp_path / "nothing")


def test_fine_tune_from_a_package_starts_from_its_weights_and_tokenizer(tmp_path):
    base = train(make_config(tmp_path, "base", steps=10, eval_every=0), quiet=True)
    text = CONFIG.format(data=tmp_path / "data.txt", cache=tmp_path / "cache", out=tmp_path / "tuned", steps=5,
                         schedule="constant", warmup=0, eval_every=0)
    text = text.replace("[model]\n", f'[model]\ninit_from = "{base.package}"\n')
    cfg = parse_config(text, "test")
    assert cfg.init_from == str(base.package) and f'init_from = "{base.package}"' in cfg.to_toml()
    tuned = train(cfg, quiet=True)
    pkg_base, pkg_tuned = evermind.load(base.package), evermind.load(tuned.package)
    assert pkg_tuned.tokenizer.to_str() == pkg_base.tokenizer.to_str()
    assert pkg_tuned.config.to_dict() == pkg_base.config.to_dict()
    # 5 small steps move the weights a little from the package's, far less than from a fresh init
    w0, w1 = pkg_base.weights, pkg_tuned.weights
    fresh = init_parameters(pkg_base.config, 0)
    k = "backbone.layers.0.mixer.in_proj.weight"
    assert 0 < np.abs(w1[k] - w0[k]).max() < np.abs(w1[k] - fresh[k]).max()
    with pytest.raises(Exception, match="no such file|not found|does not exist"):
        train(parse_config(text.replace(str(base.package), str(tmp_path / "missing.evermind")), "test"), quiet=True)
