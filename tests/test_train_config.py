"""The training config: presets load, the resolved config round-trips, every bad input is one line naming the key."""

from dataclasses import fields
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mambactl.cli.app import app
from mambactl.errors import MambactlError
from mambactl.train.config import TrainConfig, list_presets, load_config, preset_text

ROOT = Path(__file__).resolve().parents[1]
LOADABLE = ["tiny", "mamba-130m", "mamba2-130m", "mamba3-130m"]


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def error_of(path, overrides=()) -> str:
    with pytest.raises(MambactlError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", ["tiny", "mamba-130m", "mamba2-130m", "mamba3-130m"])
def test_presets_ship_identical_to_configs(name):
    assert name in list_presets()
    assert preset_text(name) == (ROOT / "configs" / f"{name}.toml").read_text(), \
        f"copy configs/{name}.toml to mambactl/train/presets/"


@pytest.mark.parametrize("name", LOADABLE)
def test_presets_load_and_round_trip(name):
    cfg = load_config(ROOT / "configs" / f"{name}.toml")
    assert TrainConfig.from_toml(cfg.to_toml()) == cfg


def test_tiny_values():
    cfg = load_config(ROOT / "configs" / "tiny.toml")
    assert (cfg.model.d_model, cfg.model.n_layer, cfg.model.vocab_size) == (64, 2, "from_tokenizer")
    assert (cfg.tokenizer.vocab_size, cfg.train.seq_len, cfg.train.batch_size, cfg.train.total_steps) == (512, 64, 8, 150)
    assert cfg.optim.betas == [0.9, 0.95] and cfg.schedule.kind == "cosine"
    model = cfg.resolve_model(512)
    assert model.vocab_size == 512 and model.layers == ["mamba1", "mamba1"]


def test_defaults_fill_missing_sections(tmp_path):
    cfg = load_config(write(tmp_path, "[optim]\nlr = 1\n"))
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)  # an integer is a fine float
    assert cfg == TrainConfig(optim=cfg.optim)


def test_resolve_model_vocab():
    """An explicit vocab_size must equal the tokenizer's: the package written at the end pairs them one to
    one, so a mismatch is refused before training rather than after it."""
    cfg = TrainConfig.from_dict({"model": {"vocab_size": 1000}})
    assert cfg.resolve_model(1000).vocab_size == 1000
    for tokens in (900, 1001):
        with pytest.raises(MambactlError, match="model.vocab_size: 1000 differs"):
            cfg.resolve_model(tokens)


def test_tokens_instead_of_steps(tmp_path):
    cfg = load_config(write(tmp_path, "[train]\nbatch_size = 2\nseq_len = 10\ngrad_accum = 3\ntokens = 601\n"))
    assert (cfg.train.steps, cfg.train.total_steps) == (0, 11)  # ceil(601 / 60)
    assert TrainConfig.from_toml(cfg.to_toml()) == cfg


def test_tokenizer_path_instead_of_vocab_size(tmp_path):
    cfg = load_config(write(tmp_path, '[tokenizer]\npath = "tok.json"\n'))
    assert (cfg.tokenizer.path, cfg.tokenizer.vocab_size) == ("tok.json", 0)


BAD = [  # (TOML text, the key the error must name, a word of what is allowed)
    ("[optim]\nlrr = 1e-3\n", "optim.lrr", "allowed: lr"),
    ("[optimizer]\nlr = 1e-3\n", "optimizer", "allowed"),
    ("optim = 3\n", "optim", "table"),
    ("[model]\nd_modell = 64\n", "model.d_modell", "allowed"),
    ("[model.mamba1]\nd_sate = 4\n", "model.mamba1.d_sate", "allowed"),
    # wrong types
    ("[train]\nbatch_size = true\n", "train.batch_size", "integer"),
    ("[train]\nbatch_size = 8.0\n", "train.batch_size", "integer"),
    ("[train]\nseed = \"0\"\n", "train.seed", "integer"),
    ("[train]\ndevice = 0\n", "train.device", "string"),
    ("[optim]\nlr = \"fast\"\n", "optim.lr", "number"),
    ("[optim]\nlr = true\n", "optim.lr", "number"),
    ("[optim]\ndecay_embeddings = 1\n", "optim.decay_embeddings", "true or false"),
    ("[optim]\nbetas = 0.9\n", "optim.betas", "list of numbers"),
    ("[data]\npaths = \"a.txt\"\n", "data.paths", "list of strings"),
    ("[data]\npaths = [\"a.txt\", 3]\n", "data.paths", "list of strings"),
    ("[package]\ntags = [1]\n", "package.tags", "list of strings"),
    ("[schedule]\nkind = \"linear\"\n", "schedule.kind", '"cosine"'),
    ("[model]\nvocab_size = \"big\"\n", "model.vocab_size", "from_tokenizer"),
    ("[model]\nvocab_size = true\n", "model.vocab_size", "integer"),
    ("[model]\nd_model = true\n", "model.d_model", "integer"),
    ("[model]\nnorm_eps = \"small\"\n", "model.norm_eps", "number"),
    ("[model]\nmamba1 = 3\n", "model.mamba1", "table"),
    ("[model.mamba1]\nconv_bias = 1\n", "model.mamba1.conv_bias", "true or false"),
    # out of range
    ("[optim]\nlr = 0\n", "optim.lr", "> 0"),
    ("[optim]\nlr = nan\n", "optim.lr", "finite"),
    ("[optim]\nlr = inf\n", "optim.lr", "finite"),
    ("[optim]\nbetas = [0.9, 1.0]\n", "optim.betas", "[0, 1)"),
    ("[optim]\nbetas = [0.9]\n", "optim.betas", "two numbers"),
    ("[optim]\neps = 0\n", "optim.eps", "> 0"),
    ("[optim]\nweight_decay = -0.1\n", "optim.weight_decay", ">= 0"),
    ("[optim]\ngrad_clip = -1\n", "optim.grad_clip", ">= 0"),
    ("[optim]\nmax_delta = -1e-3\n", "optim.max_delta", ">= 0"),
    ("[schedule]\nwarmup_steps = -1\n", "schedule.warmup_steps", ">= 0"),
    ("[schedule]\nmin_lr_ratio = 1.5\n", "schedule.min_lr_ratio", "[0, 1]"),
    ("[schedule]\ndecay_fraction = 0\n", "schedule.decay_fraction", "(0, 1]"),
    ("[train]\nbatch_size = 0\n", "train.batch_size", ">= 1"),
    ("[train]\nseq_len = 0\n", "train.seq_len", ">= 1"),
    ("[train]\ngrad_accum = 0\n", "train.grad_accum", ">= 1"),
    ("[train]\neval_batches = 0\n", "train.eval_batches", ">= 1"),
    ("[train]\nkeep_checkpoints = 0\n", "train.keep_checkpoints", ">= 1"),
    ("[train]\nlog_every = 0\n", "train.log_every", ">= 1"),
    ("[train]\nsteps = -5\n", "train.steps", ">= 0"),
    ("[train]\neval_every = -1\n", "train.eval_every", ">= 0"),
    ("[train]\ncheckpoint_every = -1\n", "train.checkpoint_every", ">= 0"),
    ("[train]\nseed = -1\n", "train.seed", ">= 0"),
    ("[train]\nsteps = 0\n", "train.steps, train.tokens", "exactly one"),
    ("[train]\nsteps = 10\ntokens = 1000\n", "train.steps, train.tokens", "exactly one"),
    ("[train]\ndevice = \" \"\n", "train.device", "auto"),
    ("[train]\nout_dir = \"\"\n", "train.out_dir", "directory"),
    ("[train]\nmatmul_precision = \"bf16\"\n", "train.matmul_precision", '"fp32", "f16"'),
    ("[data]\nval_fraction = 0\n", "data.val_fraction", "(0, 0.5]"),
    ("[data]\nval_fraction = 0.6\n", "data.val_fraction", "(0, 0.5]"),
    ("[data]\ndefault_corpus_bytes = 0\n", "data.default_corpus_bytes", ">= 10000"),
    ("[tokenizer]\nvocab_size = 100\n", "tokenizer.vocab_size", "[257,"),
    ("[tokenizer]\nvocab_size = 0\n", "tokenizer.path, tokenizer.vocab_size", "exactly one"),
    ("[tokenizer]\npath = \"t.json\"\nvocab_size = 512\n", "tokenizer.path, tokenizer.vocab_size", "exactly one"),
    ("[package]\nname = \"my model\"\n", "package.name", "letters"),
    ("[package]\nversion = \"\"\n", "package.version", "non-empty"),
    ("[model]\nn_layer = 0\n", "model.n_layer", "positive"),
    ("[model]\nnorm_eps = 2\n", "model.norm_eps", "(0, 1)"),
    ("[model]\nn_layer = 2\nlayers = [\"mamba1\"]\n", "model.layers", "n_layer"),
    ("[model.mamba1]\ndt_rank = \"many\"\n", "model.mamba1.dt_rank", "auto"),
]


@pytest.mark.parametrize("text,key,allowed", BAD, ids=[b[1] + ":" + b[0].splitlines()[-1] for b in BAD])
def test_bad_values_name_the_key_and_the_file(tmp_path, text, key, allowed):
    path = write(tmp_path, text)
    message = error_of(path)
    assert message.startswith(f"{path}: {key}")
    assert allowed in message


def test_invalid_toml_and_missing_file(tmp_path):
    assert "invalid TOML" in error_of(write(tmp_path, "[optim\nlr = 1\n"))
    assert "no such config file" in error_of(tmp_path / "missing.toml")


def test_overrides_apply_in_order(tmp_path):
    path = ROOT / "configs" / "tiny.toml"
    cfg = load_config(path, ["optim.lr=1e-3", "train.device=cpu", "model.mamba1.d_state=8",
                             'data.paths=["a.txt", "b/*.jsonl"]', "model.vocab_size=1024", "optim.lr=2e-3"])
    assert cfg.optim.lr == 2e-3
    assert cfg.train.device == "cpu"  # not TOML: taken as a bare string
    assert cfg.model.mamba1.d_state == 8
    assert cfg.data.paths == ["a.txt", "b/*.jsonl"]
    assert cfg.model.vocab_size == 1024
    assert cfg.train.total_steps == 150 and cfg.tokenizer.vocab_size == 512


def test_override_turns_the_alternative_off(tmp_path):
    path = write(tmp_path, "[train]\ntokens = 100000\n")
    cfg = load_config(path, ["train.steps=20"])
    assert (cfg.train.steps, cfg.train.tokens, cfg.train.total_steps) == (20, 0, 20)
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["tokenizer.path=tok.json"])
    assert (cfg.tokenizer.path, cfg.tokenizer.vocab_size) == ("tok.json", 0)


@pytest.mark.parametrize("override,key", [
    ("optim.lr", "expected section.key=value"),
    ("lr=1e-3", "expected section.key=value"),
    ("optim.=1", "expected section.key=value"),
    ("optim.lrr=1e-3", "optim.lrr: unknown key"),
    ("nosuch.key=1", "nosuch: unknown section"),
    ("optim.lr=-1", "optim.lr: must be"),
    ("optim.lr=abc", "optim.lr: must be a number"),
    ("train.batch_size=true", "train.batch_size: must be an integer"),
    ("train.steps=1e3", "train.steps: must be an integer"),
    ("optim.lr.x=1", "optim.lr: is not a table"),
])
def test_bad_overrides_name_the_override_and_key(override, key):
    path = ROOT / "configs" / "tiny.toml"
    message = error_of(path, ["optim.lr=1e-3", override])
    assert message.startswith(f"{path} (--set {override}): ")
    assert key in message


def test_config_is_validated_before_data_is_read(tmp_path):
    cfg = load_config(write(tmp_path, '[data]\npaths = ["does/not/exist.txt"]\n'))
    assert cfg.data.paths == ["does/not/exist.txt"]


def test_init_writes_a_preset_and_refuses_to_overwrite(tmp_path):
    runner, out = CliRunner(), tmp_path / "config.toml"
    result = runner.invoke(app, ["init", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == preset_text("tiny")
    assert load_config(out) == load_config(ROOT / "configs" / "tiny.toml")

    result = runner.invoke(app, ["init", "--preset", "mamba-130m", "-o", str(out)])
    assert isinstance(result.exception, MambactlError) and "--force" in str(result.exception)
    assert out.read_text() == preset_text("tiny")

    result = runner.invoke(app, ["init", "--preset", "mamba-130m", "-o", str(out), "--force"])
    assert result.exit_code == 0 and out.read_text() == preset_text("mamba-130m")

    result = runner.invoke(app, ["init", "--preset", "huge", "-o", str(tmp_path / "x.toml")])
    assert isinstance(result.exception, MambactlError) and "tiny" in str(result.exception)


def test_docs_list_every_key():
    docs = (ROOT / "docs" / "configuration.md").read_text()
    cfg = TrainConfig()
    tables = {name: getattr(cfg, name) for name in ("model", "data", "tokenizer", "optim", "schedule", "train",
                                                     "package")}
    tables["model.mamba1"] = cfg.model.mamba1
    for section, obj in tables.items():
        heading = f"\n### [{section}]\n" if "." in section else f"\n## [{section}]\n"
        part = docs.split(heading)[1].split("\n#")[0]
        for f in fields(obj):
            if f.name != "mamba1":
                assert f"| `{f.name}` |" in part, f"docs/configuration.md: [{section}] lacks {f.name}"
