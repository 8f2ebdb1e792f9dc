import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import subprocess  # noqa: E402
import zlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402


# --- GPU op fixtures ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rt():
    """The runtime with poisoning on: every new tensor starts as NaN, so an element a kernel forgets to write
    (or reads before writing) fails the comparison."""
    from mambactl.runtime.gpu import get_runtime

    runtime = get_runtime()
    old, runtime.poison = runtime.poison, True
    yield runtime
    runtime.poison = old


@pytest.fixture
def force_chunk(monkeypatch):
    """force_chunk(n): every SSD / Mamba-3 scan that is given no chunk runs at n (mambactl.ops.ssd.FORCE_CHUNK)
    for this test, whatever the adapter's pick (kernel_chunk) and the model config's chunk_size; None: the pick."""
    from mambactl.ops import ssd

    def force(chunk):
        monkeypatch.setattr(ssd, "FORCE_CHUNK", chunk)

    return force


@pytest.fixture
def rng(request):
    """Random data seeded by the test's name: the same data in every process (Python's hash() is not)."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


# --- package / tokenizer fixtures (tests/test_tokenizer.py, tests/test_package.py) -----------------------------

PKG_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Mamba is a selective state space model.\n"
    "Ünïcödé wörds, 日本語のテキスト, emoji 🙂🚀, tabs\tand  double  spaces; numbers 12345 and 3.14159.\n"
    "def f(x):\n    return x * 2  # code, too\n"
) * 40


@pytest.fixture(scope="session")
def pkg_corpus(tmp_path_factory):
    """A small UTF-8 training text file."""
    path = tmp_path_factory.mktemp("pkg_corpus") / "corpus.txt"
    path.write_text(PKG_CORPUS, encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def pkg_tokenizer(pkg_corpus):
    """A byte-level BPE trained on `pkg_corpus` with the default specials (vocab 320)."""
    from mambactl.package import train_tokenizer

    return train_tokenizer([pkg_corpus], 320, progress=False)


@pytest.fixture(scope="session")
def pkg_model(pkg_tokenizer):
    """(ModelConfig, float32 weights) of a tiny 2-layer model whose vocab matches `pkg_tokenizer`."""
    from mambactl.models.config import ModelConfig
    from mambactl.models.params import init_parameters
    from mambactl.package.tokenizer import vocab_size

    cfg = ModelConfig(vocab_size=vocab_size(pkg_tokenizer), d_model=16, n_layer=2)
    return cfg, init_parameters(cfg, seed=0)


@pytest.fixture
def pkg_cli(tmp_path):
    """Run `python -m mambactl ARGS...` in tmp_path; returns the CompletedProcess (text, stdout/stderr captured)."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                          os.environ.get("PYTHONPATH", "")])}

    def run(*args, stdin=None):
        return subprocess.run([sys.executable, "-m", "mambactl", *map(str, args)], cwd=tmp_path, env=env,
                              input=stdin, capture_output=True, text=True, encoding="utf-8", timeout=120)

    return run


@pytest.fixture
def pkg_one_line_error():
    """Check a CLI failure: exit 1, one `error:` line on stderr containing each needle, and no traceback."""

    def check(result, *needles):
        err = result.stderr.strip()
        assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
        assert "Traceback" not in result.stdout + result.stderr
        assert len(err.splitlines()) == 1 and err.startswith("error:"), err
        for needle in needles:
            assert needle in err, (needle, err)

    return check


# --- GPU fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu():
    """The process's runtime with poisoning on: every new tensor starts as NaN, so an element a kernel
    forgets to write fails the comparison."""
    from mambactl.runtime.gpu import get_runtime

    rt = get_runtime()
    rt.poison = True
    yield rt
    rt.poison = False
