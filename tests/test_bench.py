"""The benchmarks still run and still check what they claim, at tiny shapes on whatever adapter CI has.

Nothing here times anything (speed claims are bench/ results in docs/performance.md); these guard the scripts
against rot: tile_shapes.py's numpy check of every config, and ssd.py's FLOP / byte accounting covering every
ssd_tile pipeline a layer dispatches (ops.ssd.kernel_costs is keyed by pipeline label, so a mode or constant
added without its cost would read as 0 FLOPs and no rate).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run_bench(script: str, *args: str, out: Path) -> list[dict]:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args, "--out", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_tile_shapes_every_config_matches_numpy(tmp_path):
    configs = ["64x64/4x4", "64x64/4x4/late", "64x64/8x4/late/ka", "64x64/4x4/kb", "64x128/8x8/late/ka/kb"]
    lines = run_bench("tile_shapes.py", "--tiles", "3", "--rows", "64", "--cols", "128", "--k", "48", "--scale",
                      "--configs", ",".join(configs), "--repeats", "1", "--warm-s", "0", out=tmp_path / "t.jsonl")
    assert [line["config"] for line in lines] == configs
    for line in lines:
        assert line["max_rel_err"] < 1e-5, line
        assert line["ms"] > 0 and line["tflops"] > 0


def test_tile_shapes_unpadded_swizzled_configs_match_numpy(tmp_path):
    """128 × 256 tiles fill the workgroup memory unpadded: their K-contiguous operands go through the XOR swizzle."""
    configs = ["128x256/8x16/late", "128x256/8x16/late/ka", "128x256/8x16/kb"]
    lines = run_bench("tile_shapes.py", "--tiles", "2", "--rows", "128", "--cols", "256", "--k", "48",
                      "--configs", ",".join(configs), "--repeats", "1", "--warm-s", "0", out=tmp_path / "w.jsonl")
    assert [line["config"] for line in lines] == configs
    assert all(line["max_rel_err"] < 1e-5 for line in lines), lines


@pytest.mark.parametrize("op,groups", [("mamba2", "1"), ("siso", "2")])
def test_ssd_bench_costs_every_tile_pipeline(tmp_path, op, groups):
    (line,) = run_bench("ssd.py", "--op", op, "--batch", "1", "--seq", "80", "--heads", "2", "--headdim", "16",
                        "--groups", groups, "--d-state", "16", "--chunk", "32", "--repeats", "1",
                        out=tmp_path / "s.jsonl")
    tiles = {name: e for name, e in line["entries"].items() if name.startswith("ssd_tile")}
    # M_CB, M_Y, M_STATE (and its GRAD), M_DXD, M_DCB, M_DB, M_DC: every mode of the forward and backward ran
    assert len(tiles) == 8, sorted(tiles)
    for name, e in tiles.items():
        assert e["flops"] > 0 and e["bytes"] > 0, name
        assert e["calls"] == 1 and e["ms"] > 0, name


def test_train_step_refuses_a_mambapy_peer_without_mambapy(monkeypatch):
    """Without mambapy, transformers' use_mambapy silently runs its sequential loop: not the peer, so no ratio."""
    import argparse
    import importlib.util

    monkeypatch.syspath_prepend(str(BENCH))
    import train_step

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mambapy" else real(name, *a))
    for impl in ("hf-mambapy", "mambapy"):
        peer = train_step.run_peer(argparse.Namespace(peer=impl, peer_script=__file__), gpu_adapter=False)
        assert peer["impl"] == impl and "mambapy is not importable" in peer["error"], peer
