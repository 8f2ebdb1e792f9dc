"""Mesa llvmpipe's loop budget: on llvmpipe (lavapipe, GL llvmpipe: the CPU adapter) every loop of a shader
invocation exits early, silently, once 65,535 loop iterations have run in that invocation in total
(LP_MAX_TGSI_LOOP_ITERATIONS). Each test here runs an op at the smallest realistic shape whose per-invocation
loop count would exceed that budget if one invocation walked all of it, and compares with the float64
reference, so a kernel that silently loses iterations fails. On other adapters they are ordinary checks.
The per-invocation loop counts are written next to each shape."""

import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.ops import checks
from mambactl.reference import mamba3 as ref_mamba3

BUDGET = checks.LOOP_BUDGET


def rel_err(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30))


def rng_normal(seed, *shape, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


# --- helpers: the detector itself ------------------------------------------------------------------------------
def test_budget_helpers(gpu):
    """loop_budget raises only on llvmpipe; segment_length fits the budget there and is everything elsewhere."""
    big = BUDGET + 1
    if checks.is_llvmpipe(gpu):
        with pytest.raises(ShapeError, match="llvmpipe"):
            checks.loop_budget(gpu, "op", (1, 2), big)
        assert checks.segment_length(gpu, "op", (1,), 10_000, 100) * 100 <= checks.SEGMENT_BUDGET
    else:
        checks.loop_budget(gpu, "op", (1, 2), big)
        assert checks.segment_length(gpu, "op", (1,), 10_000, 100) == 10_000
    checks.loop_budget(gpu, "op", (1, 2), BUDGET)
    assert checks.segment_length(gpu, "op", (1,), 100, 10**6, segment=7, multiple=4) == 8


# --- Mamba-3 scan ------------------------------------------------------------------------------------------------
def test_mamba3_scan_long(gpu):
    """B 1, L 256, H 1, R 1, N 64, P 64: the forward walks 256 steps of 1 + N + N(1 + R) + R(1 + N(1 + R)) = 322
    iterations (82k per thread); the backward's adjoint 256 steps of ~422 (108k per p-block thread)."""
    from mambactl.ops.mamba3_scan import (backward_adjoint_loops_per_step, forward_loops_per_step, mamba3_scan,
                                          mamba3_scan_backward)
    from test_ops_mamba3_scan import GRADS, NAMES, make_inputs

    B, L, H, R, N, P = 1, 256, 1, 1, 64, 64
    assert L * forward_loops_per_step(R, N) > BUDGET and L * backward_adjoint_loops_per_step(R, N) > BUDGET
    x = make_inputs(B, L, H, R, N, P)
    dy = rng_normal(1, B, L, H, R, P)
    y, saved = mamba3_scan(*(gpu.from_numpy(x[k]) for k in NAMES))
    grads = mamba3_scan_backward(saved, gpu.from_numpy(dy))
    x64 = [x[k].astype(np.float64) for k in NAMES]
    assert rel_err(y.numpy(), ref_mamba3.mamba3_scan_sequential(*x64)) < 1e-4
    for name, got, want in zip(GRADS, grads, ref_mamba3.mamba3_scan_backward(*x64, dy.astype(np.float64))):
        assert rel_err(got.numpy(), want) < 1e-4, name
