"""The Mamba-3 mixer on the GPU (mambactl/models/mamba3.py) against the float64 reference block
(mambactl/reference/mamba3.py): output, dx and every parameter gradient, SISO and MIMO, with and without the
out-norm, grouped B/C, an A_floor that binds."""

from types import SimpleNamespace

import numpy as np
import pytest

from mambactl.models.mamba3 import mamba3_backward, mamba3_forward
from mambactl.reference import mamba3 as ref


def block_config(mimo, norm, H=2, P=4, G=1, N=8, R=1, S=2, d_model=6, chunk=4, A_floor=1e-4):
    """Only the fields the block reads (the same names as ModelConfig's)."""
    m = SimpleNamespace(d_state=N, headdim=P, ngroups=G, is_mimo=mimo, is_outproj_norm=norm, A_floor=A_floor,
                        chunk_size=chunk)
    return SimpleNamespace(mamba3=m, mamba3_d_inner=H * P, mamba3_nheads=H, mamba3_rank=R if mimo else 1,
                           mamba3_num_rope_angles=S, d_model=d_model)


def block_params(cfg, rng):
    di, H, P, G, N, R, S = ref._dims(cfg)
    d = cfg.d_model

    def f(*shape, scale=0.3):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    p = {"in_proj.weight": f(2 * di + 2 * R * G * N + 3 * H + S, d, scale=0.5), "dt_bias": f(H, scale=1.0),
         "B_bias": f(H, R, N), "C_bias": f(H, R, N), "B_norm.weight": 1 + f(N), "C_norm.weight": 1 + f(N),
         "D": f(H), "out_proj.weight": f(d, di)}
    if cfg.mamba3.is_outproj_norm:
        p["norm.weight"] = 1 + f(di)
    if cfg.mamba3.is_mimo:
        p.update(mimo_x=1 + f(H, R, P), mimo_z=1 + f(H, R, P), mimo_o=1 + f(H, R, P))
    return p


def rel(got, want):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), "unwritten (NaN-poisoned) or non-finite elements in the GPU output"
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("mimo,norm,dims,length", [
    (False, False, {}, 7),                                   # SISO, L not a multiple of the chunk
    (False, True, dict(H=4, G=2, A_floor=0.8), 9),           # grouped B/C, out-norm, A_floor binding
    (True, True, dict(R=2, S=3), 5),                         # MIMO rank 2, 3 of 4 pairs rotated
    (True, False, dict(R=3, G=2, S=4, chunk=8), 1),          # MIMO rank 3, one token
])
@pytest.mark.parametrize("kernel_chunk", [None, 2])  # the pick (one chunk), or 2 (not chunk_size; ragged)
def test_block_matches_reference(gpu, force_chunk, mimo, norm, dims, length, kernel_chunk):
    cfg = block_config(mimo, norm, **dims)
    force_chunk(kernel_chunk)
    rng = np.random.default_rng(0)
    p = block_params(cfg, rng)
    batch = 2
    x = rng.standard_normal((batch, length, cfg.d_model)).astype(np.float32)
    dy = rng.standard_normal((batch, length, cfg.d_model)).astype(np.float32)
    p64 = {k: v.astype(np.float64) for k, v in p.items()}
    y_ref, saved_ref = ref.mamba3_block(p64, x.astype(np.float64), cfg)
    dx_ref, grads_ref = ref.mamba3_block_backward(p64, saved_ref, dy.astype(np.float64), cfg)

    params = {k: gpu.from_numpy(v) for k, v in p.items()}
    grads = {k: gpu.from_numpy(np.zeros_like(v)) for k, v in p.items()}
    y, saved = mamba3_forward(params, gpu.from_numpy(x.reshape(batch * length, -1)), batch, length, cfg)
    dx = mamba3_backward(params, grads, saved, gpu.from_numpy(dy.reshape(batch * length, -1)), cfg)
    assert rel(y.numpy().reshape(y_ref.shape), y_ref) < 1e-4
    assert rel(dx.numpy().reshape(dx_ref.shape), dx_ref) < 1e-4
    assert set(grads_ref) == set(grads)
    for k, want in grads_ref.items():
        assert rel(grads[k].numpy(), want) < 1e-4, (k, rel(grads[k].numpy(), want))


# --- whole language models -------------------------------------------------------------------------------------------

def lm_configs():
    from mambactl.models.config import Mamba2Config, Mamba3Config, ModelConfig

    return {
        # two SISO layers, L spanning chunks and not a multiple of the chunk
        "siso": (ModelConfig(vocab_size=37, d_model=16, n_layer=2, layers=["mamba3"] * 2,
                             mamba3=Mamba3Config(d_state=8, headdim=8, chunk_size=8)), 2, 19),
        # MIMO rank 2 with the out-norm, grouped B/C, every pair rotated, next to a Mamba-2 layer
        "mimo": (ModelConfig(vocab_size=20, d_model=16, n_layer=2, layers=["mamba2", "mamba3"],
                             mamba2=Mamba2Config(d_state=4, headdim=8, chunk_size=8),
                             mamba3=Mamba3Config(d_state=8, headdim=8, ngroups=2, chunk_size=8, is_mimo=True,
                                                 mimo_rank=2, rope_fraction=1.0, is_outproj_norm=True)), 1, 13),
    }


# The kernel chunk: the adapter's pick, or 7 (not the configs' chunk_size, at which the reference runs, nor L; a
# ragged last chunk).
@pytest.mark.parametrize("kernel_chunk", [None, 7])
@pytest.mark.parametrize("name", ["siso", "mimo"])
def test_gpu_lm_matches_float64_reference(gpu, force_chunk, name, kernel_chunk):
    from lm_checks import assert_lm_matches_reference

    cfg, batch, length = lm_configs()[name]
    assert kernel_chunk is None or (kernel_chunk != cfg.mamba3.chunk_size and length % kernel_chunk)
    force_chunk(kernel_chunk)
    assert_lm_matches_reference(gpu, cfg, batch, length)


def test_mamba3_model_loss_falls(gpu):
    """30 AdamW steps on one short sequence: a two-layer Mamba-3 LM memorises it."""
    from lm_checks import overfit_losses
    from mambactl.models.config import Mamba3Config, ModelConfig

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layer=2, layers=["mamba3"] * 2,
                      mamba3=Mamba3Config(d_state=16, headdim=16, chunk_size=16))
    first, last = overfit_losses(gpu, cfg, steps=30)
    assert np.isfinite(last) and last < first / 2, (first, last)
