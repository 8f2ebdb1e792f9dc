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
@pytest.mark.parametrize("R", [1, 2])
def test_mamba3_scan_long(gpu, R):
    """B 1, L 768, H 1, N 64, P 64. MIMO (R 2) runs the recurrent kernels: one walk costs forward_loops_per_step
    (151 here) and backward_adjoint_loops_per_step (125) iterations a step, so 768 steps pass the budget (~116k
    and ~96k). SISO (R 1) runs the chunked SSD core, whose in-chunk loops are bounded by the chunk, P and N and
    whose walks over the 12 chunks go in segments on llvmpipe."""
    from mambactl.ops.mamba3_scan import (backward_adjoint_loops_per_step, forward_loops_per_step, mamba3_scan,
                                          mamba3_scan_backward)
    from test_ops_mamba3_scan import GRADS, NAMES, make_inputs

    B, L, H, N, P = 1, 768, 1, 64, 64
    if R > 1:
        assert L * forward_loops_per_step(R, N) > BUDGET and L * backward_adjoint_loops_per_step(R, N) > BUDGET
    x = make_inputs(B, L, H, R, N, P)
    dy = rng_normal(1, B, L, H, R, P)
    y, saved = mamba3_scan(*(gpu.from_numpy(x[k]) for k in NAMES))
    grads = mamba3_scan_backward(saved, gpu.from_numpy(dy))
    x64 = [x[k].astype(np.float64) for k in NAMES]
    assert rel_err(y.numpy(), ref_mamba3.mamba3_scan_sequential(*x64)) < 1e-4
    for name, got, want in zip(GRADS, grads, ref_mamba3.mamba3_scan_backward(*x64, dy.astype(np.float64))):
        assert rel_err(got.numpy(), want) < 1e-4, name


# --- Mamba-3 block: prep (θ running sum / reverse ∂θ sum) and scan through the model ------------------------------
def _mamba3_block(gpu, length, **dims):
    from mambactl.models.mamba3 import mamba3_backward, mamba3_forward
    from test_models_mamba3_gpu import block_config, block_params, rel

    cfg = block_config(False, False, **dims)
    rng = np.random.default_rng(0)
    p = block_params(cfg, rng)
    x = rng.standard_normal((1, length, cfg.d_model)).astype(np.float32)
    dy = rng.standard_normal((1, length, cfg.d_model)).astype(np.float32)
    p64 = {k: v.astype(np.float64) for k, v in p.items()}
    y_ref, saved_ref = ref_mamba3.mamba3_block(p64, x.astype(np.float64), cfg)
    dx_ref, grads_ref = ref_mamba3.mamba3_block_backward(p64, saved_ref, dy.astype(np.float64), cfg)
    params = {k: gpu.from_numpy(v) for k, v in p.items()}
    grads = {k: gpu.from_numpy(np.zeros_like(v)) for k, v in p.items()}
    y, saved = mamba3_forward(params, gpu.from_numpy(x.reshape(length, -1)), 1, length, cfg)
    dx = mamba3_backward(params, grads, saved, gpu.from_numpy(dy.reshape(length, -1)), cfg)
    assert rel(y.numpy().reshape(y_ref.shape), y_ref) < 1e-4
    assert rel(dx.numpy().reshape(dx_ref.shape), dx_ref) < 1e-4
    for k, want in grads_ref.items():
        assert rel(grads[k].numpy(), want) < 1e-4, (k, rel(grads[k].numpy(), want))


def test_mamba3_block_long(gpu):
    """B 1, L 256, H 1, P 64, N 64, S 16: the scan as above. The prep's θ walks (one lane walks a 16th of the
    steps twice) stay far below the budget here; tests/test_ops_mamba3_prep.py walks past it."""
    from mambactl.ops.mamba3_prep import prep_walk_loops

    assert prep_walk_loops(256) < BUDGET
    _mamba3_block(gpu, 256, H=1, P=64, N=64, S=16, d_model=8, chunk=64)


@pytest.mark.parametrize("segment", [1, 3])
def test_mamba3_block_segmented(gpu, monkeypatch, segment):
    """The llvmpipe path (walks split into dispatches) at small segments on any adapter."""
    monkeypatch.setattr(checks, "FORCE_SEGMENT", segment)
    _mamba3_block(gpu, 11, H=2, P=4, N=8, S=2, d_model=6, chunk=4)


# --- Mamba-1 selective scan ----------------------------------------------------------------------------------------
def test_selective_scan_subgroup_long(gpu):
    """The subgroup kernels (CPU adapters with 8-lane subgroups, N ≤ 16): B 1, L 131,072, Dc 8, N 16 (one
    subgroup): a forward invocation's time loop alone runs 131k iterations (the wrapper counts 3 per step),
    a backward one's 164k (177 per chunk of 128 steps counted), so both walks are split into segments on
    llvmpipe (in one dispatch each, y and du came out 70-80% off there)."""
    from mambactl.ops.selective_scan import (SUBGROUP_LANES, selective_scan, selective_scan_backward,
                                             subgroup_backward_loops_per_chunk, subgroup_forward_loops_per_step)
    from test_ops_selective_scan import GRADS, NAMES, make_inputs, reference

    if gpu.info.type != "CPU" or gpu.subgroup_size != SUBGROUP_LANES:
        pytest.skip("the subgroup path runs on CPU adapters with 8-lane subgroups")
    B, L, Dc, N = 1, 131_072, 8, 16
    assert L * subgroup_forward_loops_per_step(N) > BUDGET
    assert L // 128 * subgroup_backward_loops_per_chunk(N, 128) > BUDGET
    x = make_inputs(B, L, Dc, N)
    dy = rng_normal(1, B, L, Dc)
    y, saved = selective_scan(*(gpu.from_numpy(x[k]) for k in NAMES), path="subgroup")
    grads = selective_scan_backward(saved, gpu.from_numpy(dy), path="subgroup")
    y_ref, grads_ref = reference(x, dy)
    assert rel_err(y.numpy(), y_ref) < 1e-4
    for name, got, want in zip(GRADS, grads, grads_ref):
        assert rel_err(got.numpy(), want) < 1e-4, name


@pytest.mark.parametrize("path", ["tiled", "direct"])
def test_selective_scan_long(gpu, path):
    """The direct kernels (CPU adapters): B 1, L 2048, Dc 2, N 128: a forward invocation runs 129 iterations per
    step (264k over L), a backward one ~33k per chunk of 128 steps (534k): one chunk per dispatch. The tiled
    (GPU) kernels, whose loops run once per sub-tile of 4 steps: B 1, L 32,768, Dc 2, N 32 (8 lanes per
    channel): the wrapper counts 4 iterations per step in the forward (131k over L) and 289 per chunk in the
    backward (74k), so both are split into segments on llvmpipe."""
    from mambactl.ops.selective_scan import (direct_backward_loops_per_chunk, direct_forward_loops_per_step,
                                             lanes_backward_loops_per_chunk, lanes_fit, lanes_forward_loops_per_step,
                                             selective_scan, selective_scan_backward)
    from test_ops_selective_scan import GRADS, NAMES, make_inputs, reference

    if path == "tiled":
        B, L, Dc, N = 1, 32_768, 2, 32
        if not lanes_fit(gpu, N):
            pytest.skip("the tiled kernels need 8-lane subgroups for N = 32")
        assert L * lanes_forward_loops_per_step(N) > BUDGET
        assert L // 128 * lanes_backward_loops_per_chunk(N, 128, gpu.subgroup_size) > BUDGET
    else:
        B, L, Dc, N = 1, 2048, 2, 128
        assert L * direct_forward_loops_per_step(N) > BUDGET
        assert L // 128 * direct_backward_loops_per_chunk(N, 128) > BUDGET
    x = make_inputs(B, L, Dc, N)
    dy = rng_normal(1, B, L, Dc)
    y, saved = selective_scan(*(gpu.from_numpy(x[k]) for k in NAMES), path=path)
    grads = selective_scan_backward(saved, gpu.from_numpy(dy), path=path)
    y_ref, grads_ref = reference(x, dy)
    assert rel_err(y.numpy(), y_ref) < 1e-4
    for name, got, want in zip(GRADS, grads, grads_ref):
        assert rel_err(got.numpy(), want) < 1e-4, name


# --- embedding scatter-add (CSR segment per token id) --------------------------------------------------------------
@pytest.mark.parametrize("tokens,segment", [(70_000, None), (50, 3)])
def test_embedding_backward_repeated_token(gpu, tokens, segment):
    """One token id repeated `tokens` times: its (id, dim) thread walks `tokens` positions (70,000 > budget; a
    batch of padding). segment = 3: the llvmpipe path at small segments."""
    from mambactl.ops import embedding
    from mambactl.reference.embedding import embedding_backward as ref_backward

    V, D = 5, 2
    ids = np.zeros(tokens, np.int64)
    ids[::50] = 3  # id 0: 68,600 of 70,000
    dy = rng_normal(2, tokens, D)
    acc = rng_normal(3, V, D)
    d_table = gpu.from_numpy(acc)
    embedding.embedding_backward(embedding.EmbeddingGradPlan(gpu, ids), gpu.from_numpy(dy), d_table,
                                 segment=segment)
    want = acc.astype(np.float64) + ref_backward(ids, dy.astype(np.float64), V)
    assert rel_err(d_table.numpy(), want) < 1e-5


# --- attention: bounded at realistic shapes, refused past the budget on llvmpipe -----------------------------------
def test_attention_long(gpu):
    """Dh 128 at L 2048: forward ~17k, dQ ~28k, dK/dV ~19k iterations per invocation (attention_loops), under the
    budget (reached near L 4.8k, which `attention` refuses on llvmpipe); checked at L 1024 to stay cheap."""
    from mambactl.ops.attention import attention_loops
    from test_ops_attention import check

    assert attention_loops(2048, 128) <= BUDGET
    check(gpu, (1, 1024, 1, 128))


def test_attention_over_budget_is_refused(gpu):
    """An L whose walk exceeds the budget: a one-line ShapeError on llvmpipe, before anything is recorded."""
    from mambactl.ops.attention import attention, attention_loops

    L = 8192
    assert attention_loops(L, 128) > BUDGET
    if not checks.is_llvmpipe(gpu):
        pytest.skip("the budget is llvmpipe's")
    x = gpu.from_numpy(np.zeros((1, L, 1, 128), np.float32))
    with pytest.raises(ShapeError, match="attention.*65535"):
        attention(x, x, x)


def test_attention_step_budget():
    """A decoding step over 2,048 cached positions at Dh 128 is ~2.2k iterations; the budget is reached near 62k."""
    from mambactl.ops.attention import attention_step_loops

    assert attention_step_loops(2048, 128) < BUDGET < attention_step_loops(65536, 128)


# --- cross-entropy over the GPT-NeoX vocabulary (mamba-130m) --------------------------------------------------------
def test_cross_entropy_neox_vocab(gpu):
    """V 50,280: a forward thread runs 2·ceil(V / 256) + 16 = 410 iterations; the backward has no loop."""
    from mambactl.ops.cross_entropy import cross_entropy, cross_entropy_backward
    from mambactl.reference import cross_entropy as ref_ce

    M, V = 3, 50_280
    logits = rng_normal(4, M, V, scale=3.0)
    targets = np.array([0, V - 1, 12345], np.int32)
    loss, lse = cross_entropy(gpu.from_numpy(logits), gpu.from_numpy(targets), M)
    dl = cross_entropy_backward(gpu.from_numpy(logits), gpu.from_numpy(targets), lse, M)
    want_loss = ref_ce.cross_entropy(logits.astype(np.float64), targets)
    want_dl = ref_ce.cross_entropy_backward(logits.astype(np.float64), targets)
    assert abs(float(loss.numpy()[0]) - want_loss) < 1e-4 * max(1.0, abs(want_loss))
    assert rel_err(dl.numpy(), want_dl) < 1e-4


# --- Mamba-2 SSD ---------------------------------------------------------------------------------------------------
# Per-invocation counts (mambactl/ops/ssd.py's kernel_loops: upper bounds, no loop unrolled). Inside a chunk every
# loop is bounded by the chunk Q (≤ 1024), P, N and the heads per M_DCB workgroup (≤ 16 where 8 planes allow): at
# Q 256, P = N = 128 ssd_tile ≤ 764, ssd_rows_backward 101, ssd_prep 50; at Q 1024 and 64 heads per group ≤ 9.3k,
# 668, 56; ssd_step N. Only the walks over chunks grow with L: ssd_state_passing 1 per chunk,
# ssd_state_passing_backward 1 + 8 per chunk (a workgroup sum of W_c each: past the budget from 7,282 chunks),
# ssd_param_grads 1 per (batch, chunk) partial. Those go in dispatch segments on llvmpipe.
def test_ssd_in_chunk_loops_bounded():
    """The largest chunk the op takes (1024) at P = N = 128 and 64 heads per group stays well under the budget,
    so no in-chunk loop needs splitting at realistic shapes."""
    from mambactl.ops.ssd import MAX_CHUNK, kernel_loops

    loops = kernel_loops(MAX_CHUNK, 128, 128, 64, 1)
    loops.pop("ssd_tile_lanes")  # the CPU tile engine runs only where its loops fit (ops.ssd.tile_engine)
    assert max(loops.values()) < BUDGET / 4, loops
    assert kernel_loops(256, 128, 128)["ssd_tile"] < 2000


def test_ssd_largest_chunk(gpu):
    """B 1, L 1030, H 1, P 64, N 128, chunk 1024 (a full chunk and a partial one): the in-chunk kernels at their
    longest loops (ssd_tile ≤ 2.7k iterations per invocation) against the float64 reference (which runs
    at chunk 64: the same function, and its chunk-1024 einsums take minutes)."""
    from mambactl.ops.ssd import kernel_loops
    from test_ops_ssd import GRADS, make_inputs, reference, run_gpu

    B, L, H, P, G, N = 1, 1030, 1, 64, 1, 128
    loops = kernel_loops(1024, P, N)
    assert loops.pop("ssd_tile_lanes") > BUDGET  # so ssd_tile runs here on every adapter (ops.ssd.tile_engine)
    assert max(loops.values()) < BUDGET
    x = make_inputs(B, L, H, P, G, N)
    dy = rng_normal(1, *x["x"].shape)
    y, grads, _ = run_gpu(gpu, x, dy, 1024)
    y_ref, grads_ref = reference(x, dy, 64)
    assert rel_err(y, y_ref) < 1e-4
    for name, got, want in zip(GRADS, grads, grads_ref):
        assert rel_err(got, want) < 1e-4, name


def _passing_inputs(gpu, batch, nchunks, heads, headdim, nstate, seed=0):
    """chunk 1, so each step's adt is the chunk's decay sum; small decays (≈ −0.02) keep the carry alive for
    thousands of chunks. -> (dims, dec, float64 cs_end [B, H, nchunks])."""
    from mambactl.ops import ssd

    rng = np.random.default_rng(seed)
    adt = (-0.02 * rng.uniform(0.5, 1.5, (batch, nchunks, heads))).astype(np.float32)
    scale = rng.standard_normal((batch, nchunks, heads)).astype(np.float32)
    dims = ssd._dims(batch, nchunks, heads, headdim, 1, nstate, 1)
    dec = ssd._prep(gpu, dims, gpu.from_numpy(adt), gpu.from_numpy(scale))
    return dims, dec, adt.astype(np.float64).transpose(0, 2, 1)


@pytest.mark.parametrize("segment", [None, 1000])
def test_ssd_state_passing_long(gpu, segment):
    """B 1, H 2, P 2, N 3, 8,192 chunks (L 8192 at chunk 1, or L 16k at chunk 2): a backward state-passing thread
    runs 8,192 · (1 + 8) = 73.7k iterations, the forward 8,192; both against float64 recurrences.
    segment = 1000: the split path with a partial last segment on any adapter."""
    from mambactl.ops import ssd

    B, nc, H, P, N = 1, 8192, 2, 2, 3
    assert nc * ssd.PASSING_BACKWARD_LOOPS > BUDGET
    dims, dec, cs_end = _passing_inputs(gpu, B, nc, H, P, N)
    decay = np.exp(cs_end)[..., None, None]  # [B, H, nc, 1, 1]
    added, part, saved = (rng_normal(s, B, nc, H, P, N) for s in (1, 2, 3))
    shape = (B, nc, H, P)

    states, last = gpu.from_numpy(added), gpu.empty((B, H, P, N))
    ssd.state_passing(gpu, dims, dec, states, last, shape, segment)
    want, run = np.zeros((B, nc, H, P, N)), np.zeros((B, H, P, N))
    for c in range(nc):
        want[:, c] = run
        run = decay[:, :, c] * run + added[:, c]
    assert rel_err(states.numpy(), want) < 1e-5
    assert rel_err(last.numpy(), run) < 1e-5

    dstates, w_part = gpu.from_numpy(part), gpu.empty((B, H, nc, 1))
    ssd.state_passing_backward(gpu, dims, dec, dstates, gpu.from_numpy(saved), w_part, shape, segment)
    want_ds, want_w, run = np.zeros((B, nc, H, P, N)), np.zeros((B, H, nc, 1)), np.zeros((B, H, P, N))
    for c in reversed(range(nc)):
        want_ds[:, c] = run
        want_w[:, :, c, 0] = decay[:, :, c, 0, 0] * np.sum(run * saved[:, c], axis=(2, 3))
        run = part[:, c] + decay[:, :, c] * run
    assert rel_err(dstates.numpy(), want_ds) < 1e-5
    assert rel_err(w_part.numpy(), want_w) < 1e-5


@pytest.mark.parametrize("accumulate,nparam", [(False, 2), (True, 2), (True, 1)])
def test_ssd_param_grads_long(gpu, accumulate, nparam):
    """70,000 (batch, chunk) partials per head (e.g. B 4 × L 17.5k at chunk 1), in dispatch segments on llvmpipe.
    Float32 sums in the kernel's fixed order (64 running sums over the partials ≡ l mod 64, carried across
    segments, then a tree over them), so the result equals numpy's float32 sums in that order exactly."""
    from mambactl.ops import ssd

    B, nc, H = 1, 70_000, 3
    assert B * nc > BUDGET
    dims = ssd._dims(B, nc, H, 1, 1, 1, 1)
    parts = rng_normal(5, B * nc, H, nparam)
    start = rng_normal(6, nparam, H)
    outs = [gpu.from_numpy(v) for v in start] if accumulate else [gpu.empty((H,)) for _ in range(nparam)]
    ssd.param_grads(gpu, dims, gpu.from_numpy(parts), outs, accumulate, (B, nc, H, 1))
    for k, out in enumerate(outs):
        lanes = np.zeros((64, H), np.float32)
        for bc in range(B * nc):  # lane l sums the partials bc ≡ l (mod 64) in order, across segments
            lanes[bc % 64] += parts[bc, :, k]
        half = 32
        while half:
            lanes[:half] += lanes[half:2 * half]
            half //= 2
        want = lanes[0]
        if accumulate:
            want = want + start[k]
        np.testing.assert_array_equal(out.numpy(), want)
        assert rel_err(out.numpy(), parts[:, :, k].astype(np.float64).sum(0) + (start[k] if accumulate else 0)) < 1e-3


@pytest.mark.parametrize("segment", [1, 2])
def test_ssd_segmented(gpu, monkeypatch, segment):
    """The llvmpipe path (walks over chunks split into dispatches) at small segments on any adapter: bit-identical
    to one dispatch, and right through the Mamba-2 LM (reference model, every gradient)."""
    from lm_checks import assert_lm_matches_reference
    from test_models_mamba2_gpu import CONFIGS
    from test_ops_ssd import GRADS, run_gpu, make_inputs

    x = make_inputs(2, 37, 4, 5, 2, 6, seed=2)
    dy = rng_normal(3, *x["x"].shape)
    y1, g1, _ = run_gpu(gpu, x, dy, 8)
    monkeypatch.setattr(checks, "FORCE_SEGMENT", segment)
    y2, g2, _ = run_gpu(gpu, x, dy, 8)
    assert np.array_equal(y1, y2)
    for name, a, b in zip(GRADS, g1, g2):
        assert np.array_equal(a, b), name
    cfg, batch, length = CONFIGS["mamba2"]
    assert_lm_matches_reference(gpu, cfg, batch, length)


def test_ssd_over_budget_is_refused(gpu):
    """N so wide that one invocation's in-chunk loops pass the budget: a one-line ShapeError naming op, kernel and
    shape on llvmpipe, before dispatch (ssd_step walks N; ssd_tile N / 16 k steps of the state term)."""
    from mambactl.ops.ssd import kernel_loops, ssd_scan, ssd_step

    N = 140_000
    assert kernel_loops(1, 1, N)["ssd_step"] > BUDGET and kernel_loops(1, 1, N)["ssd_tile"] > BUDGET
    if not checks.is_llvmpipe(gpu):
        pytest.skip("the budget is llvmpipe's")
    one = gpu.from_numpy(np.zeros(1, np.float32))
    row = gpu.from_numpy(np.zeros((1, 1), np.float32))
    bc = gpu.from_numpy(np.zeros((1, N), np.float32))
    state = gpu.from_numpy(np.zeros((1, 1, 1, N), np.float32))
    with pytest.raises(ShapeError, match="ssd_step.*65535"):
        ssd_step(state, row, row, one, bc, bc, one, one)
    x = gpu.from_numpy(np.zeros((1, 1, 1, 1), np.float32))
    bc4 = gpu.from_numpy(np.zeros((1, 1, 1, N), np.float32))
    with pytest.raises(ShapeError, match="ssd_scan.*ssd_tile.*65535"):
        ssd_scan(x, gpu.from_numpy(np.zeros((1, 1, 1), np.float32)), one, bc4, bc4, one, one, chunk=1)
