"""AdamW on the GPU (kernels/adamw.wgsl): clipping, trust region and NaN/Inf guard, no host round trip.

One `adamw_step` records: the squared global gradient norm (ops.reduce.sum_of_squares), one
`optimizer_begin_step` dispatch that decides on the GPU whether the step happens and with which clip
scale, and one `adamw_update` (vec4 where the length allows) per span: a run of parameters that are neighbouring
views of an Arena (runtime/arena.py) with the same decay, as models/lm.py lays them out, else one tensor. Nothing is flushed or read back; the trainer
calls `AdamWState.read_counters()` only when it logs. The exact CPU mirror is mambactl/reference/adamw.py.

Two guards, both leaving weights and moments untouched (the old engine updated the moments anyway):
- step level (`guard_norm=True`, the default): a non-finite global norm skips the whole step — nothing
  changes, the step count t (and so the bias correction) does not advance, `skipped_steps` goes up;
- element level (always on): where the scaled gradient, a new moment or the step is not finite, that
  element keeps its weight and moments and `bad_elements` goes up. With the step-level guard on it catches
  what a finite norm can't rule out (non-finite moments, an overflowing step); with `guard_norm=False`
  the step is never skipped, so a NaN/Inf gradient freezes only the elements it touches (that step then
  goes unclipped, since a non-finite norm gives no meaningful clip scale).
"""

from __future__ import annotations

import numpy as np

from mambactl.errors import ShapeError
from mambactl.ops.checks import U32, expect, grid_1d, is_cpu
from mambactl.ops.reduce import sum_of_squares
from mambactl.runtime.arena import Arena, spans
from mambactl.runtime.tensor import Tensor

# Words of kernels/adamw.wgsl's OptState, in order; the last four hold float32 bits.
STATE_FIELDS = ("t", "skipped", "bad", "skip_now", "scale", "bc1", "bc2", "grad_norm")


class AdamWState:
    """The optimizer's GPU state: first and second moments m[i], v[i] (each of params[i]'s shape) and
    `counters`, uint32[8] laid out as STATE_FIELDS (step count, skipped steps, bad elements, ...)."""

    def __init__(self, m: list[Tensor], v: list[Tensor], counters: Tensor):
        if len(m) != len(v) or any(a.shape != b.shape for a, b in zip(m, v)):
            raise ShapeError(f"AdamWState: m {[t.shape for t in m]} and v {[t.shape for t in v]} differ")
        expect("AdamWState", "counters", counters, (len(STATE_FIELDS),), U32)
        self.m, self.v, self.counters = list(m), list(v), counters

    @classmethod
    def zeros(cls, params: list[Tensor]) -> "AdamWState":
        """Fresh state for `params`: zero moments and counters, recorded on the GPU (no host write). Where params
        are an Arena's views (models/lm.py), the moments are views of Arenas of the same layout, so adamw_step
        updates each run of them in one dispatch."""
        rt = params[0].runtime
        return cls(Arena.like(rt, params), Arena.like(rt, params), _zero_counters(rt))

    def read_counters(self) -> dict:
        """Read back (flushes): step (updates applied), skipped_steps, bad_elements (cumulative) and
        grad_norm (the latest step's global gradient norm, before clipping; NaN/Inf if it was skipped)."""
        words = self.counters.numpy()
        return {
            "step": int(words[0]),
            "skipped_steps": int(words[1]),
            "bad_elements": int(words[2]),
            "grad_norm": float(words[7:8].view(np.float32)[0]),
        }

    def to_numpy(self) -> dict[str, np.ndarray]:
        """For checkpoints: {"counters": uint32[8], "m.i": m[i], "v.i": v[i]} (i = parameter index).
        The counters hold the bias-correction recurrence too, so a resumed run continues bitwise."""
        out = {"counters": self.counters.numpy()}
        for i, (a, b) in enumerate(zip(self.m, self.v)):
            out[f"m.{i}"], out[f"v.{i}"] = a.numpy(), b.numpy()
        return out

    @classmethod
    def from_numpy(cls, runtime, arrays: dict, params: list[Tensor] | None = None) -> "AdamWState":
        """The inverse of to_numpy; with `params` the moments are laid out like them (as `zeros` does)."""
        n = sum(1 for k in arrays if k.startswith("m."))
        try:
            m_host = [np.asarray(arrays[f"m.{i}"], np.float32) for i in range(n)]
            v_host = [np.asarray(arrays[f"v.{i}"], np.float32) for i in range(n)]
            counters = runtime.from_numpy(np.asarray(arrays["counters"], np.uint32))
        except KeyError as e:
            raise ShapeError(f"AdamWState.from_numpy: optimizer state lacks {e.args[0]!r}") from None
        if params is not None and len(params) == n and all(p.shape == a.shape for p, a in zip(params, m_host)):
            m, v = Arena.like(runtime, params), Arena.like(runtime, params)
            for t, a in zip(m + v, m_host + v_host):
                runtime.write(t, a)
        else:
            m, v = [runtime.from_numpy(a) for a in m_host], [runtime.from_numpy(a) for a in v_host]
        return cls(m, v, counters)


def adamw_step(params: list[Tensor], grads: list[Tensor], state: AdamWState, *, lr: float, beta1: float = 0.9,
               beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
               no_decay: list[bool] | None = None, max_grad_norm: float = 0.0, max_delta: float = 0.0,
               guard_norm: bool = True) -> None:
    """Record one AdamW step over params[i] (updated in place) from grads[i] (same shapes); no flush.

    max_grad_norm: clip the global gradient norm to this (<= 0: no clipping). max_delta: bound |step| per
    element (<= 0: no bound). no_decay[i]: params[i] gets no weight decay. guard_norm: skip the whole step
    when the global norm is not finite (see the module docstring). lr may change every step (schedules).
    """
    if not params or len(grads) != len(params) or len(state.m) != len(params):
        raise ShapeError(f"adamw_step: {len(params)} params, {len(grads)} grads, {len(state.m)} moment pairs")
    no_decay = [False] * len(params) if no_decay is None else list(no_decay)
    if len(no_decay) != len(params):
        raise ShapeError(f"adamw_step: no_decay has {len(no_decay)} flags for {len(params)} params")
    for i, (p, g, m, v) in enumerate(zip(params, grads, state.m, state.v)):
        expect("adamw_step", f"params[{i}]", p)
        expect("adamw_step", f"grads[{i}]", g, p.shape)
        expect("adamw_step", f"state.m[{i}]", m, p.shape)
        expect("adamw_step", f"state.v[{i}]", v, p.shape)
    rt = params[0].runtime
    # 1 - beta is formed in float64 and rounded once: 1 - float32(beta) would be off by up to 6e-8
    # absolute, i.e. 6e-5 relative for beta = 0.999.
    om1, om2 = 1.0 - beta1, 1.0 - beta2
    norm_sq = sum_of_squares(grads)
    rt.run("optimizer_begin_step", (1,), norm_sq=norm_sq, state=state.counters, one_minus_beta1=om1,
           one_minus_beta2=om2, max_norm=float(max_grad_norm), guard_norm=int(bool(guard_norm)))
    # One dispatch per run of Arena views with the same decay (the gaps between them are zero in all four and
    # stay zero: g = m = v = 0 gives a zero step), else one per tensor.
    for first, (p, g, m, v) in spans(params, grads, state.m, state.v, keys=no_decay):
        nd = no_decay[first]
        if p.size == 0:
            continue
        keep = 1.0 if nd else 1.0 - lr * weight_decay
        hp = dict(n=p.size, lr=float(lr), beta1=float(beta1), beta2=float(beta2), one_minus_beta1=om1,
                  one_minus_beta2=om2, eps=float(eps), keep=float(keep), max_delta=float(max_delta))
        if p.size % 4 == 0:
            textured = is_cpu(rt) and rt.fits_texture(p, g, m, v)
            tex = dict(param_tex=p, grad_tex=g, m_tex=m, v_tex=v) if textured else dict.fromkeys(
                ("param_tex", "grad_tex", "m_tex", "v_tex"))
            rt.run("adamw_update_vec4", grid_1d(p.size // 4), {"TEXTURED": textured}, state=state.counters, param4=p,
                   grad4=g, m4=m, v4=v, **tex, **hp)
        else:
            rt.run("adamw_update", grid_1d(p.size), state=state.counters, param=p, grad=g, m=m, v=v, **hp)


def _zero_counters(rt) -> Tensor:
    counters = rt.empty((len(STATE_FIELDS),), np.uint32)
    # The fill kernel writes float bits; 0.0 is all-zero bits, so it zeroes the u32 words too.
    rt.run("fill", grid_1d(counters.size), dst=counters, n=counters.size, value=0.0)
    return counters
