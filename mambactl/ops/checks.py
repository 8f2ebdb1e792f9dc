"""Argument checks shared by every op wrapper: raise ShapeError naming the op and tensor before dispatch."""

from __future__ import annotations

import numpy as np

from mambactl.errors import ShapeError
from mambactl.runtime.gpu import grid_1d  # noqa: F401  (re-exported for the op wrappers)
from mambactl.runtime.tensor import Tensor

F32, I32, U32 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint32)


def expect(op: str, name: str, t, shape=None, dtype=F32) -> Tensor:
    """`shape` may contain None for "any size here"."""
    if not isinstance(t, Tensor):
        raise ShapeError(f"{op}: {name} must be a GPU Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise ShapeError(f"{op}: {name} has dtype {t.dtype.name}, expected {np.dtype(dtype if not isinstance(dtype, tuple) else dtype[0]).name}")
    if shape is not None:
        ok = len(shape) == t.ndim and all(s is None or s == d for s, d in zip(shape, t.shape))
        if not ok:
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ShapeError(f"{op}: {name} has shape {t.shape}, expected {want}")
    return t


def expect_columns(op: str, name: str, t: Tensor, start: int, count: int) -> None:
    """t's columns [start, start + count) along its last dimension exist (an op reads or writes them in place)."""
    width = t.shape[-1]
    if start < 0 or start + count > width:
        raise ShapeError(f"{op}: {name} columns [{start}, {start + count}) outside its {width} columns")


# --- CPU adapters ------------------------------------------------------------------------------------------------
# Software adapters (Mesa lavapipe / llvmpipe) take barrier-free kernels; where their subgroups have 8 lanes
# (lavapipe on AVX2) the *_subgroup kernels, which broadcast from lanes 0-7, share loads across them.
SUBGROUP_LANES = 8


def is_cpu(rt) -> bool:
    """Whether the runtime's adapter is a CPU (software) adapter."""
    return getattr(getattr(rt, "info", None), "type", None) == "CPU"


def cpu_subgroups(rt) -> bool:
    """Whether the *_subgroup kernels are the choice here: a CPU adapter with SUBGROUP_LANES-lane subgroups."""
    return is_cpu(rt) and rt.subgroup_size == SUBGROUP_LANES


def rows_kernel(rt, loops: int, rows_path: bool | None, textured=()) -> bool:
    """Whether an op takes its *_rows kernel (one invocation per row, walking it in a loop, reading `textured`
    through textures): on CPU adapters, while a row's `loops` iterations stay within llvmpipe's loop budget and
    those tensors fit textures; `rows_path` forces either (tests)."""
    if rows_path is not None:
        return bool(rows_path)
    return is_cpu(rt) and loops <= SEGMENT_BUDGET and rt.fits_texture(*textured)


def require_subgroup_lanes(rt, what: str) -> None:
    """Refuse a forced subgroup kernel where subgroups do not have SUBGROUP_LANES lanes (`what` names it)."""
    if rt.subgroup_size != SUBGROUP_LANES:
        raise ShapeError(f"{what} needs {SUBGROUP_LANES}-lane subgroups; this adapter has {rt.subgroup_size or 'none'}")


# --- Mesa llvmpipe's loop budget -------------------------------------------------------------------------------
# Mesa's llvmpipe (lavapipe's Vulkan and the GL llvmpipe adapter: our CPU path) stops EVERY loop of a shader
# invocation once LP_MAX_TGSI_LOOP_ITERATIONS = 65,535 loop iterations have run in it in total, silently. Kernels
# that walk a long range per thread (a scan over time, a CSR segment) therefore split their walk into segments,
# one dispatch each, carrying their state in a buffer, when the adapter is llvmpipe (`segment_length`); wrappers
# whose loop count they cannot bound call `loop_budget`, which refuses the shape up front.
LOOP_BUDGET = 65535
# Segments are sized to this fraction of the budget: the per-step counts below are upper bounds written by hand,
# and a compiler that unrolls a loop only lowers the real count, so a factor of two covers a miscount.
SEGMENT_BUDGET = LOOP_BUDGET // 2
# Tests set this to run every segmented walk in segments of this many steps on any adapter (the path llvmpipe
# takes), through the models as well as the op wrappers.
FORCE_SEGMENT: int | None = None


def is_llvmpipe(rt) -> bool:
    """Whether the runtime's adapter is Mesa llvmpipe (name, vendor or driver say so)."""
    info = getattr(rt, "info", None)
    if info is None:
        return False
    text = " ".join(str(getattr(info, f, "")) for f in ("name", "vendor", "driver")).lower()
    return "llvmpipe" in text


def loop_budget(rt, op: str, shape, iterations: int) -> None:
    """Raise ShapeError (before anything is recorded) when an invocation of `op` would run more loop iterations
    than llvmpipe allows, on llvmpipe adapters only; elsewhere a no-op."""
    if iterations > LOOP_BUDGET and is_llvmpipe(rt):
        raise ShapeError(
            f"{op}: shape {shape} needs up to {int(iterations)} loop iterations per shader invocation, over Mesa "
            f"llvmpipe's limit of {LOOP_BUDGET} (it would silently cut the loops short); use smaller shapes on "
            f"this CPU adapter or a GPU")


def segments(total: int, seg: int) -> list[tuple[int, int]]:
    """The [lo, hi) pieces of range(total), `seg` long (the last may be shorter), in order."""
    return [(lo, min(lo + seg, total)) for lo in range(0, total, seg)]


def segment_length(rt, op: str, shape, total: int, per_step: int, fixed: int = 0, multiple: int = 1,
                   segment: int | None = None) -> int:
    """Steps per dispatch for a kernel that walks `total` steps per invocation at most `per_step` loop
    iterations each (plus `fixed` once per dispatch). `segment` forces a length (tests; rounded to `multiple`);
    otherwise all steps at once, except on llvmpipe: the most steps (a multiple of `multiple`) that fit
    SEGMENT_BUDGET, and a ShapeError (`loop_budget`) if even `multiple` steps don't fit."""
    total = max(int(total), 1)
    if segment is None:
        segment = FORCE_SEGMENT
    if segment is not None:
        seg = max(int(segment), 1)
        seg = -(-seg // multiple) * multiple
        return min(seg, -(-total // multiple) * multiple)
    if not is_llvmpipe(rt):
        return -(-total // multiple) * multiple
    steps = (SEGMENT_BUDGET - fixed) // max(int(per_step), 1)
    steps = steps // multiple * multiple
    if steps < multiple:  # not even one step within the safety margin: the real budget decides
        loop_budget(rt, op, shape, fixed + multiple * per_step)
        return multiple
    return min(steps, -(-total // multiple) * multiple)
