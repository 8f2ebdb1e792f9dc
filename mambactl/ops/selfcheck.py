"""A small forward/backward through the core ops, checked against the float64 reference.

Used by `mambactl smoke` to show on any machine that the adapter computes what the reference does.
"""

from __future__ import annotations

import numpy as np

from mambactl.ops import activations, cross_entropy, linear, rmsnorm
from mambactl.reference import activations as ref_act
from mambactl.reference import cross_entropy as ref_ce
from mambactl.reference import linear as ref_linear
from mambactl.reference import rmsnorm as ref_norm


def selfcheck(rt, rows: int = 33, dim: int = 48, vocab: int = 97, seed: int = 0) -> dict[str, float]:
    """loss = CE(linear(silu(rmsnorm(x))), targets); returns relative errors of the loss and dx, dW."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    w = (rng.standard_normal((vocab, dim)) / np.sqrt(dim)).astype(np.float32)
    t = rng.integers(0, vocab, rows).astype(np.int32)
    gx, gg, gw, gt = (rt.from_numpy(a) for a in (x, g, w, t))

    n, rstd = rmsnorm.rmsnorm(gx, gg)
    h = activations.silu(n)
    logits = linear.linear(h, gw)
    loss, lse = cross_entropy.cross_entropy(logits, gt, rows)
    dlogits = cross_entropy.cross_entropy_backward(logits, gt, lse, rows)
    dh, dw, _ = linear.linear_backward(h, gw, dlogits)
    dn = activations.silu_backward(n, dh)
    dx, _ = rmsnorm.rmsnorm_backward(gx, gg, rstd, dn)

    x64, g64, w64 = x.astype(np.float64), g.astype(np.float64), w.astype(np.float64)
    rn = ref_norm.rmsnorm(x64, g64)
    rh = ref_act.silu(rn)
    rlogits = ref_linear.linear(rh, w64)
    rloss = ref_ce.cross_entropy(rlogits, t)
    rdh, rdw, _ = ref_linear.linear_backward(rh, w64, ref_ce.cross_entropy_backward(rlogits, t))
    rdx, _ = ref_norm.rmsnorm_backward(x64, g64, ref_act.silu_backward(rn, rdh))

    def rel(a, b):
        return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))

    return {"loss": rel(loss.numpy(), [rloss]), "dx": rel(dx.numpy(), rdx), "dW": rel(dw.numpy(), rdw),
            "loss_value": float(loss.numpy()[0])}
