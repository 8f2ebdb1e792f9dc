"""Data-parallel training over MPI (mambactl/train/distributed.py, docs/distributed.md).

The end-to-end tests launch `mpirun -n 2 python -m mambactl train` on the software adapter and are skipped
when mpirun or mpi4py is missing (CI installs Debian's OpenMPI and mpi4py in .ci/run). The unit tests of the
gradient buckets and the batch split need neither.
"""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mambactl.errors import MambactlError
from mambactl.runtime.gpu import get_runtime
from mambactl.train import distributed
from mambactl.train.checkpoint import load_checkpoint

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))

# The global batch is train.batch_size = 4: two ranks take 2 rows each, one process all 4.
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
path = "{tokenizer}"
[optim]
lr = 1e-2
weight_decay = 0.01
[schedule]
kind = "cosine"
warmup_steps = 2
[train]
batch_size = 4
seq_len = 16
steps = 8
eval_every = 4
eval_batches = 2
checkpoint_every = 4
keep_checkpoints = 3
log_every = 2
"""

LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK")
have_mpi = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None
needs_mpi = pytest.mark.skipif(not have_mpi, reason="needs mpirun and mpi4py (apt-get install openmpi-bin "
                                                    "libopenmpi-dev; pip install mpi4py)")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("MAMBACTL_TEST_")}
    # Open MPI: CI runs as root on 2 cores, in a container without ptrace (no CMA single-copy).
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               OMPI_MCA_btl_vader_single_copy_mechanism="none")
    return env


def _run(args, timeout: float, **extra_env) -> tuple[subprocess.CompletedProcess, float]:
    """Run a command in its own process group; on timeout kill the whole group (mpirun and its ranks)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**_env(), **extra_env}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, args))} did not finish within {timeout} s (hung)\n{out}\n{err}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err), time.perf_counter() - t0


def _train(config: Path, out: Path, ranks: int | None, *extra, timeout: float = 180, **env):
    cmd = [sys.executable, "-m", "mambactl", "train", str(config), "--out", str(out), "-q", *extra]
    if ranks is not None:
        cmd = ["mpirun", "-n", str(ranks), *cmd]
    return _run(cmd, timeout, **env)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from mambactl.package.tokenizer import save_tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("dist")
    data = root / "data.txt"
    data.write_text(TEXT)
    tokenizer = root / "tokenizer.json"
    save_tokenizer(train_tokenizer([data], 300, progress=False), tokenizer)  # one tokenizer for every run
    config = root / "config.toml"
    config.write_text(CONFIG.format(data=data, cache=root / "cache", tokenizer=tokenizer))
    return root, config


def _relative_difference(a: dict, b: dict) -> float:
    """The largest ‖a − b‖ / ‖b‖ over the parameter tensors."""
    assert a.keys() == b.keys()
    return max(float(np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)) for k in a)


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


@needs_mpi
def test_two_ranks_match_one_process_with_the_whole_batch_and_resume_on_every_rank(setup):
    root, config = setup
    one, t_one = _train(config, root / "one", None)
    assert one.returncode == 0, one.stderr
    two, t_two = _train(config, root / "two", 2)
    assert two.returncode == 0, two.stdout + two.stderr
    print(f"1 process: {t_one:.1f} s; mpirun -n 2: {t_two:.1f} s")

    for step in (4, 8):
        _, w_one, opt_one, state_one = load_checkpoint(root / "one" / "checkpoints" / f"step-{step}")
        _, w_two, opt_two, state_two = load_checkpoint(root / "two" / "checkpoints" / f"step-{step}")
        assert _relative_difference(w_two, w_one) < 1e-5, step
        assert state_two == state_one  # the same sampler state: the same global batches were drawn
        assert opt_two["counters"][0] == opt_one["counters"][0] == step
    # Rank 0 alone logged: the same events; the global mean losses and the validation metrics agree.
    for kind, keys in (("train", ("train_loss", "grad_norm")), ("eval", ("val_loss", "top1", "top5"))):
        e_one, e_two = _events(root / "one", kind), _events(root / "two", kind)
        assert [e["step"] for e in e_two] == [e["step"] for e in e_one] and e_one
        for a, b in zip(e_one, e_two):
            for key in keys:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (kind, a["step"], key)
    assert "training summary" in two.stdout and two.stdout.count("training summary") == 1
    assert (root / "two" / "model.evermind").is_file()

    # --resume: every rank loads the checkpoint (here the single process's step 4) and continues as one.
    resumed = root / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "one" / "checkpoints" / "step-4", resumed / "checkpoints" / "step-4")
    r, t_resume = _train(config, resumed, 2, "--resume")
    assert r.returncode == 0, r.stdout + r.stderr
    _, w_one, _, _ = load_checkpoint(root / "one" / "checkpoints" / "step-8")
    _, w_resumed, _, _ = load_checkpoint(resumed / "checkpoints" / "step-8")
    assert _relative_difference(w_resumed, w_one) < 1e-5
    print(f"mpirun -n 2 --resume: {t_resume:.1f} s")


@needs_mpi
def test_a_failing_rank_ends_the_job_naming_the_rank(setup):
    root, config = setup
    r, seconds = _train(config, root / "fail", 2, timeout=90, MAMBACTL_TEST_FAIL_RANK="1", MAMBACTL_TEST_FAIL_STEP="3")
    assert r.returncode != 0
    assert "error: rank 1 (of 2):" in r.stderr and "MAMBACTL_TEST_FAIL_RANK" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (root / "fail" / "model.evermind").exists()
    print(f"failing rank: job ended in {seconds:.1f} s")


# Without MPI -----------------------------------------------------------------------------------------------------
def test_outside_a_launcher_training_is_the_single_process_path(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # would fail if init() tried to import it
    assert distributed.launched_size() is None and distributed.init() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert distributed.init() is None  # a one-rank job is the single-process path too


def test_a_multi_rank_launch_without_mpi4py_says_how_to_install_it(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(MambactlError, match=r"mambactl\[mpi\]"):
        distributed.init()


class _FakeMPI:
    """Stands in for mpi4py.MPI: an all-reduce over `world` ranks that all hold the same gradients."""

    IN_PLACE, SUM = object(), object()

    class Request:
        @staticmethod
        def Testall(requests):
            return True

        @staticmethod
        def Waitall(requests):
            return None

    def __init__(self, world: int):
        self.world = world


class _FakeComm:
    def __init__(self, world: int):
        self.world, self.calls = world, []

    def Iallreduce(self, send, recv, op):
        self.calls.append(recv.size)
        recv *= self.world
        return object()


class _FakeDist:
    def __init__(self, world: int):
        self.MPI, self.comm = _FakeMPI(world), _FakeComm(world)


def test_gradient_buckets_round_trip_every_element():
    rt = get_runtime()
    rng = np.random.default_rng(0)
    shapes = [(3, 5), (7,), (0,), (64, 40), (2, 2, 3), (9,), (300, 20), (1,)]
    values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [rt.from_numpy(v) for v in values]
    dist = _FakeDist(3)
    reducer = distributed.GradReducer(dist, grads, bucket_bytes=4096)
    # Tensors in order, several per bucket where they fit, a large one alone, the empty one nowhere.
    assert reducer.buckets == [[0, 1], [3], [4, 5], [6], [7]]
    reducer.allreduce()
    assert dist.comm.calls == [22, 2560, 21, 6000, 1]
    for v, g, s in zip(values, grads, shapes):
        np.testing.assert_array_equal(g.numpy(), 3 * v)
        assert g.shape == s


def test_every_rank_gets_a_contiguous_share_of_the_global_batch():
    class D(distributed.Distributed):
        def __init__(self, rank, world):
            self.rank, self.world = rank, world

    ids = np.arange(10).reshape(5, 2)
    parts = [D(r, 2).shard((ids, ids + 100)) for r in range(2)]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), ids)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), ids + 100)
    assert [len(p[0]) for p in parts] == [3, 2]
    with pytest.raises(MambactlError, match="batch_size 1 is the global batch"):
        D(0, 2).check_batch(1)
