"""Mamba-3 SISO fold into a Mamba-2 SSD (kernels/mamba3_fold.wgsl): the input scale the SSD core runs with, the
correction that turns its output g_t q_t into the Mamba-3 output h_t q_t, and their exact backward. The same
maths as mambactl/reference/mamba3.py's `mamba3_fold_scale` / `mamba3_fold_output` / `mamba3_fold_backward`:

    δ_t = (1 − λ_t) Δ_t (0 after each sequence's last step),  s_t = λ_t Δ_t + δ_{t+1},
    y_t = y_core_t − δ_{t+1} v_t (k_t · q_t).

Shapes (SISO, rank 1 dropped): q, k [B, L, H, N]; v, y_core, y [B, L, H, P]; dt = Δ, lam = λ [B, L, H].
"""

from __future__ import annotations

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect, grid_1d, is_cpu, loop_budget
from mambactl.runtime.tensor import Tensor

FOLD_GROUP = 64  # mirrors FW: the output kernels' workgroup
FOLD_LANES = 64  # lanes per (batch, step, head) row on GPUs (the kernel's FL); CPU adapters take 1


def _check(op: str, q, k, v, dt, lam) -> dict:
    expect(op, "q", q, (None, None, None, None))
    batch, length, heads, nstate = q.shape
    if min(q.shape) < 1:
        raise ShapeError(f"{op}: q has shape {q.shape}; every dimension must be at least 1")
    expect(op, "k", k, q.shape)
    expect(op, "v", v, (batch, length, heads, None))
    if v.shape[3] < 1:
        raise ShapeError(f"{op}: v has shape {v.shape}; the head dimension must be at least 1")
    for name, t in (("dt", dt), ("lam", lam)):
        expect(op, name, t, (batch, length, heads))
    return dict(rows=batch * length * heads, len=length, heads=heads, nstate=nstate, headdim=v.shape[3])


def _check_scalars(op: str, dt, lam) -> dict:
    expect(op, "dt", dt, (None, None, None))
    if min(dt.shape) < 1:
        raise ShapeError(f"{op}: dt has shape {dt.shape}; every dimension must be at least 1")
    expect(op, "lam", lam, dt.shape)
    batch, length, heads = dt.shape
    return dict(rows=batch * length * heads, len=length, heads=heads, nstate=1, headdim=1)


def fold_lanes(rt, lanes: int | None = None) -> int:
    """Lanes per row of the output kernels: `lanes` if given (tests run several), else FOLD_LANES on GPUs and 1
    on CPU adapters (`rt.info.type == "CPU"`: there a barrier and a workgroup cost more than one invocation
    walking N and P)."""
    if lanes is not None:
        if lanes < 1 or FOLD_GROUP % lanes:
            raise ShapeError(f"mamba3_fold: {lanes} lanes per row must divide {FOLD_GROUP}")
        return int(lanes)
    return 1 if is_cpu(rt) else FOLD_LANES


def output_loops(nstate: int, headdim: int, lanes: int) -> int:
    """Loop iterations per invocation of mamba3_fold_output(_backward) (for Mesa llvmpipe's budget): the strided
    walks over N (twice) and P (twice) and the log2(lanes) reduction rounds."""
    return 2 * -(-nstate // lanes) + 2 * -(-headdim // lanes) + lanes.bit_length() - 1


def mamba3_fold_scale(dt: Tensor, lam: Tensor) -> Tensor:
    """Δ, λ [B, L, H] -> the SSD core's input scale s [B, L, H]."""
    params = _check_scalars("mamba3_fold_scale", dt, lam)
    scale = dt.runtime.empty(dt.shape)
    dt.runtime.run("mamba3_fold_scale", grid_1d(params["rows"]), dt=dt, lam=lam, scale=scale, **params)
    return scale


def mamba3_fold_output(y_core: Tensor, q: Tensor, k: Tensor, v: Tensor, dt: Tensor, lam: Tensor,
                       lanes: int | None = None) -> Tensor:
    """The core's output g_t q_t [B, L, H, P] -> the Mamba-3 output h_t q_t (a new tensor). `lanes`: see
    `fold_lanes`."""
    op = "mamba3_fold_output"
    params = _check(op, q, k, v, dt, lam)
    expect(op, "y_core", y_core, v.shape)
    rt = q.runtime
    lanes = fold_lanes(rt, lanes)
    loop_budget(rt, op, tuple(v.shape), output_loops(params["nstate"], params["headdim"], lanes))
    y = rt.empty(v.shape)
    rt.run(op, grid_1d(params["rows"] * lanes, FOLD_GROUP), {"FL": lanes}, y_core=y_core, q=q, k=k, v=v, dt=dt,
           lam=lam, y=y, **params)
    return y


def mamba3_fold_backward(q: Tensor, k: Tensor, v: Tensor, dt: Tensor, lam: Tensor, dy: Tensor, dq: Tensor,
                         dk: Tensor, dv: Tensor, dscale: Tensor,
                         lanes: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The adjoint of `mamba3_fold_output` and `mamba3_fold_scale` around the core: dy [B, L, H, P] (what the
    core's backward was given), the core's dq (∂C), dk (∂B), dv (∂x) — corrected in place — and dscale [B, L, H]
    -> (dq, dk, dv, ddt, dlam). ∂loss/∂adt is the core's, unchanged. `lanes`: see `fold_lanes`."""
    op = "mamba3_fold_backward"
    params = _check(op, q, k, v, dt, lam)
    for name, t, like in (("dy", dy, v), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v), ("dscale", dscale, dt)):
        expect(op, name, t, like.shape)
    rt = q.runtime
    lanes = fold_lanes(rt, lanes)
    loop_budget(rt, op, tuple(v.shape), output_loops(params["nstate"], params["headdim"], lanes))
    ddelta, ddt, dlam = rt.empty(dt.shape), rt.empty(dt.shape), rt.empty(dt.shape)
    rt.run("mamba3_fold_output_backward", grid_1d(params["rows"] * lanes, FOLD_GROUP), {"FL": lanes}, q=q, k=k,
           v=v, dt=dt, lam=lam, dy=dy, dscale=dscale, dq=dq, dk=dk, dv=dv, ddelta=ddelta, **params)
    rt.run("mamba3_fold_scale_backward", grid_1d(params["rows"]), dt=dt, lam=lam, dscale=dscale, ddelta=ddelta,
           ddt=ddt, dlam=dlam, **params)
    return dq, dk, dv, ddt, dlam
