"""Mamba-3 SISO fold into the SSD core (kernels/mamba3_fold.wgsl): the input scale and the diagonal weight the
core (mambactl/ops/ssd.py `ssd_chunked`) runs with, and their exact backward. The same maths as
mambactl/reference/mamba3.py's `mamba3_fold_scale` / `mamba3_fold_backward`:

    δ_t = (1 − λ_t) Δ_t (0 after each sequence's last step),  s_t = λ_t Δ_t + δ_{t+1},  d_t = λ_t Δ_t,

with which the core's output (step t's own term weighted by d_t instead of s_t) is Mamba-3's h_t q_t.

Shapes: dt = Δ, lam = λ and every output [B, L, H].
"""

from __future__ import annotations

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect, grid_1d
from mambactl.runtime.tensor import Tensor


def _check_scalars(op: str, dt, lam) -> dict:
    expect(op, "dt", dt, (None, None, None))
    if min(dt.shape) < 1:
        raise ShapeError(f"{op}: dt has shape {dt.shape}; every dimension must be at least 1")
    expect(op, "lam", lam, dt.shape)
    batch, length, heads = dt.shape
    return dict(rows=batch * length * heads, len=length, heads=heads)


def mamba3_fold_scale(dt: Tensor, lam: Tensor) -> tuple[Tensor, Tensor]:
    """Δ, λ [B, L, H] -> (the SSD core's input scale s, its diagonal weight d) [B, L, H]."""
    params = _check_scalars("mamba3_fold_scale", dt, lam)
    rt = dt.runtime
    scale, diag = rt.empty(dt.shape), rt.empty(dt.shape)
    rt.run("mamba3_fold_scale", grid_1d(params["rows"]), dt=dt, lam=lam, scale=scale, diag=diag, **params)
    return scale, diag


def mamba3_fold_backward(dt: Tensor, lam: Tensor, dscale: Tensor, ddiag: Tensor) -> tuple[Tensor, Tensor]:
    """The adjoint of `mamba3_fold_scale`: the core's ∂loss/∂scale and ∂loss/∂diag [B, L, H] -> (ddt, dlam).
    ∂loss/∂adt and ∂q, ∂k, ∂v are the core's."""
    op = "mamba3_fold_backward"
    params = _check_scalars(op, dt, lam)
    expect(op, "dscale", dscale, dt.shape)
    expect(op, "ddiag", ddiag, dt.shape)
    rt = dt.runtime
    ddt, dlam = rt.empty(dt.shape), rt.empty(dt.shape)
    rt.run("mamba3_fold_scale_backward", grid_1d(params["rows"]), dt=dt, lam=lam, dscale=dscale, ddiag=ddiag,
           ddt=ddt, dlam=dlam, **params)
    return ddt, dlam
