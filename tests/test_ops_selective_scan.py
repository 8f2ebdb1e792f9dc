"""GPU selective scan (mambactl/ops/selective_scan.py) against the float64 reference scan, composed with
softplus(delta + delta_bias) and A = −exp(A_log) as mamba_ssm's selective_scan_fn(delta_softplus=True)."""

import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.ops.checks import is_cpu
from mambactl.ops import selective_scan as scan
from mambactl.ops.selective_scan import (PATHS, SUBGROUP_LANES, SUBGROUP_MAX_STATE, channel_lanes, direct_per_thread,
                                         lanes_fit, selective_scan, selective_scan_backward, selective_scan_step,
                                         subgroup_groups)
from mambactl.reference import selective_scan as ref
from mambactl.reference.activations import softplus, softplus_backward

NAMES = ("u", "delta", "A_log", "B", "C", "D", "z", "delta_bias")
GRADS = ("du", "ddelta", "dA_log", "dB", "dC", "dD", "dz", "ddelta_bias")


def make_inputs(batch, length, channels, nstate, seed=0):
    """Float32 inputs: Δ = softplus(delta + bias) ≈ 0.7 with a few delta > 20 (softplus's linear branch)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    delta = normal(batch, length, channels, scale=0.5)
    delta.flat[::23] = 21.0 + rng.random(delta.flat[::23].shape).astype(np.float32)
    return dict(u=normal(batch, length, channels), delta=delta,
                A_log=(np.log(np.arange(1, nstate + 1)) + normal(channels, nstate, scale=0.1)).astype(np.float32),
                B=normal(batch, length, nstate), C=normal(batch, length, nstate), D=normal(channels),
                z=normal(batch, length, channels), delta_bias=normal(channels, scale=0.2))


def reference(x, dy):
    """Float64 y and gradients, in the order of GRADS (dA_log = dA·A, ddelta through softplus)."""
    x = {k: v.astype(np.float64) for k, v in x.items()}
    pre = x["delta"] + x["delta_bias"]
    dt, A = softplus(pre), -np.exp(x["A_log"])
    args = (x["u"], dt, A, x["B"], x["C"], x["D"], x["z"])
    y = ref.selective_scan(*args)
    du, ddt, dA, dB, dC, dD, dz = ref.selective_scan_backward(*args, dy.astype(np.float64))
    ddelta = softplus_backward(pre, ddt)
    return y, (du, ddelta, dA * A, dB, dC, dD, dz, ddelta.sum(axis=(0, 1)))


def rel_err(got, want):
    # An all-zero reference (dA_log at L = 1, where every h_{t−1} is 0) must come back exactly zero.
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def skip_unsupported(rt, nstate, *paths):
    """The subgroup kernels run only on 8-lane subgroups (lavapipe on AVX2) and for N ≤ 16; the tiled ones where
    a channel's lanes fit a subgroup (N ≤ 4 · lanes: 32 on lavapipe, 128 on NVIDIA)."""
    if "tiled" in paths and not lanes_fit(rt, nstate):
        pytest.skip(f"{channel_lanes(nstate)} lanes per channel do not fit this adapter's subgroups")
    if "subgroup" in paths and rt.subgroup_size != SUBGROUP_LANES:
        pytest.skip(f"the subgroup path needs {SUBGROUP_LANES}-lane subgroups (this adapter: {rt.subgroup_size})")
    if "subgroup" in paths and nstate > SUBGROUP_MAX_STATE:
        pytest.skip(f"the subgroup path holds at most {SUBGROUP_MAX_STATE} states")


def run_gpu(rt, x, dy, chunk=128, grads=None, path=None, backward_path=None, per_thread=None):
    """`path` forces the forward's kernels ("tiled": the GPU path; "direct", "subgroup": the CPU adapters'
    paths) and, unless `backward_path` differs, the backward's."""
    y, saved = selective_scan(*(rt.from_numpy(x[k]) for k in NAMES), chunk=chunk, path=path)
    out = selective_scan_backward(saved, rt.from_numpy(dy), grads, path=backward_path or path, per_thread=per_thread)
    return y.numpy(), [g.numpy() for g in out], saved


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("batch,length,channels,nstate,chunk", [
    (1, 1, 5, 3, 128),
    (2, 2, 3, 1, 128),
    (2, 63, 9, 16, 16),    # L not a multiple of the tile or chunk
    (1, 64, 12, 16, 32),
    (2, 65, 70, 16, 32),   # channels not a multiple of the 8 per workgroup
    (1, 1000, 6, 16, 128),
    (1, 50, 5, 20, 24),    # N = 20: 4 channels of 20 threads per workgroup; tiles of 8 steps
    (2, 70, 6, 20, 32),    # tiles of 16 steps
    (1, 17, 3, 128, 8),    # the largest N, one channel per workgroup; tiles of 4 steps
])
def test_matches_reference(rt, path, batch, length, channels, nstate, chunk):
    skip_unsupported(rt, nstate, path)
    x = make_inputs(batch, length, channels, nstate)
    dy = np.random.default_rng(1).standard_normal((batch, length, channels)).astype(np.float32)
    y, grads, _ = run_gpu(rt, x, dy, chunk, path=path)
    y_ref, grads_ref = reference(x, dy)
    assert rel_err(y, y_ref) < 1e-4
    for name, got, want in zip(GRADS, grads, grads_ref):
        assert got.shape == want.shape, name
        assert rel_err(got, want) < 1e-4, (name, rel_err(got, want))


@pytest.mark.parametrize("path", PATHS)
def test_gate_read_and_dz_written_in_place(rt, path):
    """z given as columns [start, start + Dc) of wider rows (Mamba-1's in_proj output) and dz written into columns
    of a wider matrix (its gradient): the same bits as with [B, L, Dc] tensors, NaN in the other columns of z
    unread, the other columns of the dz matrix left as they were. Ragged L against the 4-step sub-chunks."""
    batch, length, channels, nstate, start, width = 2, 13, 10, 16, 7, 23
    skip_unsupported(rt, nstate, path)
    x = make_inputs(batch, length, channels, nstate, seed=3)
    dy = np.random.default_rng(4).standard_normal((batch, length, channels)).astype(np.float32)
    y, grads, _ = run_gpu(rt, x, dy, 8, path=path)
    wide = np.full((batch, length, width), np.nan, np.float32)
    wide[:, :, start:start + channels] = x["z"]
    args = [rt.from_numpy(x[k]) if k != "z" else rt.from_numpy(wide) for k in NAMES]
    y2, saved = selective_scan(*args, chunk=8, path=path, z_start=start)
    canvas = np.random.default_rng(5).standard_normal((batch, length, width)).astype(np.float32)
    dz_out = rt.from_numpy(canvas)
    out = selective_scan_backward(saved, rt.from_numpy(dy), path=path, dz_out=(dz_out, start - 2))
    want_y, want_grads = reference(x, dy)  # float64, as test_matches_reference
    assert rel_err(y2.numpy(), want_y) < 1e-4
    assert rel_err(dz_out.numpy()[:, :, start - 2:start - 2 + channels], want_grads[GRADS.index("dz")]) < 1e-4
    np.testing.assert_array_equal(y2.numpy(), y)
    for name, got, want in zip(GRADS, out, grads):
        if name != "dz":
            np.testing.assert_array_equal(got.numpy(), want, err_msg=name)
    assert out[GRADS.index("dz")] is dz_out
    expect = canvas.copy()
    expect[:, :, start - 2:start - 2 + channels] = grads[GRADS.index("dz")]
    np.testing.assert_array_equal(dz_out.numpy(), expect)


def test_gate_columns_outside_the_rows_are_refused(rt):
    x = make_inputs(1, 4, 6, 4)
    args = [rt.from_numpy(x[k]) for k in NAMES]
    with pytest.raises(ShapeError, match=r"z columns \[3, 9\) outside its 6 columns"):
        selective_scan(*args, z_start=3)
    _, saved = selective_scan(*args)
    with pytest.raises(ShapeError, match=r"dz_out columns \[1, 7\) outside its 6 columns"):
        selective_scan_backward(saved, rt.from_numpy(x["u"]), dz_out=(rt.from_numpy(x["u"]), 1))


@pytest.mark.parametrize("textures", [True, False])
def test_slice_sums_from_textures_or_buffers(rt, monkeypatch, textures):
    """dB and dC are the sums of the direct backward's per-group partials (70 groups here: one channel each): CPU adapters read them
    through a texture (count a multiple of 4), GPUs from the buffer; both against float64 on every adapter."""
    if textures and not is_cpu(rt):
        pytest.skip("the slice sums read a texture on CPU adapters only")
    if not textures:
        monkeypatch.setattr(rt, "fits_texture", lambda *tensors: False)
    x = make_inputs(2, 33, 70, 16, seed=5)
    dy = np.random.default_rng(6).standard_normal((2, 33, 70)).astype(np.float32)
    _, grads, _ = run_gpu(rt, x, dy, 16, path="direct", per_thread=1)
    _, grads_ref = reference(x, dy)
    for name, got, want in zip(GRADS, grads, grads_ref):
        assert rel_err(got, want) < 1e-4, (name, rel_err(got, want))


@pytest.mark.parametrize("batch,length,channels,nstate,chunk", [
    (2, 63, 9, 5, 16),     # N = 5: 4 lanes per channel, 2 of them without a state; L not a multiple of 4
    (2, 65, 70, 16, 32),   # channels not a multiple of a subgroup's or a workgroup's
    (1, 50, 37, 3, 32),    # N = 3: one lane of 4 holds the states
    (2, 70, 6, 20, 32),    # N = 20: 8 lanes per channel, 3 of them without a state
    (2, 41, 13, 64, 8),    # N = 64: 16 lanes per channel (where subgroups have 16 or more)
    (1, 17, 3, 128, 16),   # N = 128: 32 lanes per channel (where subgroups have 32 or more)
])
def test_tiled_matches_reference(rt, monkeypatch, batch, length, channels, nstate, chunk):
    """The GPU kernels (lanes of a subgroup per channel: the default where they fit) match the reference, run
    as the forward, the chunk-parallel walk and the backward, and their dispatch segments (forward by sub-tiles,
    backward by chunks, also where the state slots' memory sets them) are bit-identical to one dispatch."""
    skip_unsupported(rt, nstate, "tiled")
    entries = []
    run = rt.run
    monkeypatch.setattr(rt, "run", lambda entry, *a, **k: (entries.append(entry), run(entry, *a, **k)))
    x = make_inputs(batch, length, channels, nstate, seed=16)
    dy = np.random.default_rng(17).standard_normal((batch, length, channels)).astype(np.float32)
    y, grads, saved = run_gpu(rt, x, dy, chunk, path="tiled")
    assert {"selective_scan_forward", "selective_scan_backward_walk", "selective_scan_backward"} <= set(entries)
    y_ref, grads_ref = reference(x, dy)
    assert rel_err(y, y_ref) < 1e-4
    for name, got, want in zip(GRADS, grads, grads_ref):
        assert rel_err(got, want) < 1e-4, (name, rel_err(got, want))
    again = selective_scan_backward(saved, rt.from_numpy(dy), segment=1, path="tiled")
    for name, a, b in zip(GRADS, grads, again):
        assert np.array_equal(a, b.numpy()), name
    monkeypatch.setattr(scan, "SLOT_BYTES", 1)  # segments of one chunk for the slots' memory
    again = selective_scan_backward(saved, rt.from_numpy(dy), path="tiled")
    for name, a, b in zip(GRADS, grads, again):
        assert np.array_equal(a, b.numpy()), name
    y2, saved2 = selective_scan(*(rt.from_numpy(x[k]) for k in NAMES), chunk=chunk, segment=4, path="tiled")
    assert np.array_equal(y2.numpy(), y)
    assert np.array_equal(saved2.states.numpy(), saved.states.numpy())
    assert np.array_equal(saved2.last_state.numpy(), saved.last_state.numpy())


def reference_states(x):
    """Float64 states h before every step and after the last: [B, L + 1, Dc, N]."""
    x = {k: v.astype(np.float64) for k, v in x.items()}
    dt, A = softplus(x["delta"] + x["delta_bias"]), -np.exp(x["A_log"])
    hs = [np.zeros((x["u"].shape[0], x["u"].shape[2], A.shape[1]))]
    for t in range(x["u"].shape[1]):
        hs.append(ref.selective_scan_step(hs[-1], x["u"][:, t], dt[:, t], A, x["B"][:, t], x["C"][:, t], x["D"])[1])
    return np.stack(hs, axis=1)


@pytest.mark.parametrize("batch,length,channels,nstate,chunk,segment", [
    (2, 129, 9, 16, 32, None),   # a last sub-tile of one step
    (1, 96, 40, 16, 32, None),   # L a multiple of the chunk; channels past a workgroup's 32
    (2, 22, 5, 16, 32, None),    # one chunk, shorter than the chunk; an odd number of sub-tiles
    (2, 101, 7, 5, 8, 24),       # segments of 6 sub-tiles; N = 5
    (1, 70, 6, 20, 16, 12),      # N = 20: 8 lanes per channel; segments of 3 sub-tiles (an odd pair)
    (1, 3, 4, 16, 8, None),      # one partial sub-tile
])
def test_tiled_forward_matches_reference_states(rt, batch, length, channels, nstate, chunk, segment):
    """The GPU forward (sub-tiles walked in pairs, each with its own load buffer) gives y, every saved chunk
    entry state and the last state of the float64 scan (all outputs start poisoned)."""
    skip_unsupported(rt, nstate, "tiled")
    x = make_inputs(batch, length, channels, nstate, seed=20)
    y, saved = selective_scan(*(rt.from_numpy(x[k]) for k in NAMES), chunk=chunk, segment=segment, path="tiled")
    y_ref, _ = reference(x, np.zeros((batch, length, channels), np.float32))
    hs = reference_states(x)
    assert rel_err(y.numpy(), y_ref) < 1e-5
    assert rel_err(saved.states.numpy(), hs[:, ::chunk][:, :-(-length // chunk)]) < 1e-5
    assert rel_err(saved.last_state.numpy(), hs[:, -1]) < 1e-5


@pytest.mark.parametrize("path", PATHS)
def test_parameter_grads_accumulate_deterministically(rt, path):
    skip_unsupported(rt, 16, path)
    x = make_inputs(2, 40, 11, 16, seed=2)
    dy = np.random.default_rng(3).standard_normal((2, 40, 11)).astype(np.float32)
    _, fresh, _ = run_gpu(rt, x, dy, chunk=16, path=path)
    _, again, _ = run_gpu(rt, x, dy, chunk=16, path=path)
    for name, a, b in zip(GRADS, fresh, again):
        assert np.array_equal(a, b), f"{name} differs between identical runs"
    rng = np.random.default_rng(4)
    start = {"A_log": rng.standard_normal((11, 16)), "D": rng.standard_normal(11),
             "delta_bias": rng.standard_normal(11)}
    acc = {k: rt.from_numpy(v) for k, v in start.items()}
    _, summed, _ = run_gpu(rt, x, dy, chunk=16, grads=acc, path=path)
    by_name = dict(zip(GRADS, summed))
    for key, name in (("A_log", "dA_log"), ("D", "dD"), ("delta_bias", "ddelta_bias")):
        np.testing.assert_allclose(by_name[name], start[key] + dict(zip(GRADS, fresh))[name], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(acc[key].numpy(), by_name[name])


@pytest.mark.parametrize("path", PATHS)
def test_saved_states_are_chunk_boundaries_only(rt, path):
    batch, length, channels, nstate, chunk = 2, 300, 5, 16, 64
    skip_unsupported(rt, nstate, path)
    x = make_inputs(batch, length, channels, nstate)
    _, saved = selective_scan(*(rt.from_numpy(x[k]) for k in NAMES), chunk=chunk, path=path)
    n_chunks = -(-length // chunk)
    assert saved.states.shape == (batch, n_chunks, channels, nstate)
    # Everything saved beyond the inputs themselves: O(B·Dc·N·L / chunk), not the B·Dc·N·L states.
    inputs = {id(getattr(saved, k).buffer) for k in NAMES}
    extra = sum(t.size for t in vars(saved).values() if hasattr(t, "buffer") and id(t.buffer) not in inputs)
    assert extra == batch * channels * nstate * (n_chunks + 1)  # chunk entry states + the last state
    assert extra <= batch * channels * nstate * (length / chunk + 2)
    assert channel_lanes(16) == 4 and channel_lanes(3) == 4 and channel_lanes(20) == 8


@pytest.mark.parametrize("batch,length,channels,nstate,chunk,per_thread", [
    (2, 63, 9, 16, 16, 2),    # a last group with one channel
    (3, 41, 7, 5, 8, 7),      # one group: every channel in one invocation
    (1, 17, 3, 128, 8, 2),
])
def test_direct_backward_channels_per_thread(rt, batch, length, channels, nstate, chunk, per_thread):
    """The direct backward with several channels per invocation (their dB / dC added in order, then over
    groups) matches the reference and one channel per invocation."""
    x = make_inputs(batch, length, channels, nstate, seed=8)
    dy = np.random.default_rng(9).standard_normal((batch, length, channels)).astype(np.float32)
    _, one, _ = run_gpu(rt, x, dy, chunk, path="direct", per_thread=1)
    _, several, _ = run_gpu(rt, x, dy, chunk, path="direct", per_thread=per_thread)
    _, want = reference(x, dy)
    for name, a, b, w in zip(GRADS, one, several, want):
        assert rel_err(b, w) < 1e-4, name
        if name not in ("dB", "dC"):  # only the channel sums' order differs
            assert np.array_equal(a, b), name


@pytest.mark.parametrize("forward,backward,nstate", [("tiled", "direct", 20), ("direct", "tiled", 20),
                                                     ("subgroup", "tiled", 16), ("tiled", "subgroup", 16),
                                                     ("direct", "subgroup", 16), ("subgroup", "direct", 13)])
def test_paths_share_saved_states(rt, forward, backward, nstate):
    """All forwards save the same states (so any backward consumes any forward's)."""
    skip_unsupported(rt, nstate, forward, backward)
    batch, length, channels, chunk = 2, 70, 6, 32
    x = make_inputs(batch, length, channels, nstate, seed=10)
    dy = np.random.default_rng(11).standard_normal((batch, length, channels)).astype(np.float32)
    y, grads, saved = run_gpu(rt, x, dy, chunk, path=forward, backward_path=backward)
    _, other = selective_scan(*(rt.from_numpy(x[k]) for k in NAMES), chunk=chunk, path=backward)
    np.testing.assert_allclose(saved.states.numpy(), other.states.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(saved.last_state.numpy(), other.last_state.numpy(), rtol=1e-5, atol=1e-6)
    y_ref, grads_ref = reference(x, dy)
    assert rel_err(y, y_ref) < 1e-4
    for name, got, want in zip(GRADS, grads, grads_ref):
        assert rel_err(got, want) < 1e-4, name


def test_direct_path_choice(rt, monkeypatch):
    """CPU adapters take the subgroup kernels by default where subgroups have 8 lanes, else the direct ones,
    other adapters the tiled ones; the direct backward's invocations (and so its partials) stay bounded as the
    batch and channels grow."""
    x = make_inputs(1, 9, 4, 3)
    dy = np.ones((1, 9, 4), np.float32)
    entries = []
    run = rt.run
    monkeypatch.setattr(rt, "run", lambda entry, *a, **k: (entries.append(entry), run(entry, *a, **k)))
    run_gpu(rt, x, dy, chunk=8)
    suffix = ""
    if rt.info.type == "CPU":
        suffix = "_subgroup" if rt.subgroup_size == SUBGROUP_LANES else "_direct"
    assert {"selective_scan_forward" + suffix, "selective_scan_backward" + suffix} <= set(entries)
    per, groups = direct_per_thread(rt, 8, 64, 1536, 16, 128)
    assert per * groups >= 1536 and (per - 1) * groups < 1536 and groups <= 1536 // 4
    assert direct_per_thread(rt, 8, 64, 128, 16, 128, per_thread=3) == (3, 43)
    assert [subgroup_groups(c) for c in (1, 8, 9, 128)] == [1, 1, 2, 16]
    with pytest.raises(ShapeError, match="unknown path"):
        selective_scan(*(rt.from_numpy(x[k]) for k in NAMES), path="fast")


def test_without_subgroups_takes_the_direct_path(rt, monkeypatch):
    """On a GPU without the subgroup feature the tiled kernels (which use subgroup operations) are not compiled:
    the forward and the backward take the direct kernels, and forcing the tiled ones is refused."""
    monkeypatch.setattr(scan, "is_cpu", lambda rt: False)
    monkeypatch.setattr(rt, "features", tuple(f for f in rt.features if f != "subgroup"))
    x = make_inputs(2, 19, 5, 4, seed=14)
    dy = np.random.default_rng(15).standard_normal((2, 19, 5)).astype(np.float32)
    entries = []
    run = rt.run
    monkeypatch.setattr(rt, "run", lambda entry, *a, **k: (entries.append(entry), run(entry, *a, **k)))
    y, grads, saved = run_gpu(rt, x, dy, chunk=8)
    assert {"selective_scan_forward_direct", "selective_scan_backward_direct"} <= set(entries)
    assert not {"selective_scan_forward", "selective_scan_backward"} & set(entries)
    y_ref, grads_ref = reference(x, dy)
    assert rel_err(y, y_ref) < 1e-4
    for name, got, want in zip(GRADS, grads, grads_ref):
        assert rel_err(got, want) < 1e-4, name
    with pytest.raises(ShapeError, match="subgroup feature"):
        selective_scan(*(rt.from_numpy(x[k]) for k in NAMES), path="tiled")


def test_shape_errors(rt):
    x = {k: rt.from_numpy(v) for k, v in make_inputs(1, 4, 3, 2).items()}
    args = [x[k] for k in NAMES]
    bad_B = rt.from_numpy(np.zeros((1, 4, 5), np.float32))
    with pytest.raises(ShapeError, match="B has shape"):
        selective_scan(*args[:3], bad_B, *args[4:])
    with pytest.raises(ShapeError, match="state size"):
        big = rt.from_numpy(np.zeros((3, 129), np.float32))
        selective_scan(x["u"], x["delta"], big, *(rt.from_numpy(np.zeros((1, 4, 129), np.float32)) for _ in "BC"),
                       *args[5:])
    with pytest.raises(ShapeError, match="chunk"):
        selective_scan(*args, chunk=12)
    with pytest.raises(ShapeError, match="dtype"):
        selective_scan(*args[:6], rt.from_numpy(np.zeros((1, 4, 3), np.int32)), args[7])
    _, saved = selective_scan(*args)
    with pytest.raises(ShapeError, match="dy has shape"):
        selective_scan_backward(saved, rt.from_numpy(np.zeros((1, 4, 2), np.float32)))
    with pytest.raises(ShapeError, match="grads lacks"):
        selective_scan_backward(saved, rt.from_numpy(np.zeros((1, 4, 3), np.float32)), {"D": x["D"]})


def test_last_state_and_recurrent_steps_continue_the_parallel_scan(rt):
    """Prefill L steps in parallel, then decode 3 more one at a time: the outputs equal the parallel scan
    over all L + 3 steps, so generation can switch from the parallel form to O(1) steps."""
    batch, length, channels, nstate, extra = 2, 37, 6, 5, 3
    x = make_inputs(batch, length + extra, channels, nstate, seed=3)
    full, _ = selective_scan(*(rt.from_numpy(x[k]) for k in NAMES), chunk=16)
    head = {k: (v[:, :length] if v.ndim == 3 else v) for k, v in x.items()}
    _, saved = selective_scan(*(rt.from_numpy(head[k]) for k in NAMES), chunk=16)
    state = saved.last_state
    want = full.numpy()
    junk = np.random.default_rng(5).standard_normal((batch, 4)).astype(np.float32)
    for t in range(length, length + extra):
        step = {k: (np.ascontiguousarray(v[:, t]) if v.ndim == 3 else v) for k, v in x.items()}
        if t == length:
            y = selective_scan_step(state, *(rt.from_numpy(step[k]) for k in NAMES))
        else:  # z, and B with C, read in place in wider rows (Mamba-1 decoding: in_proj's and x_proj's outputs)
            args = {k: rt.from_numpy(step[k]) for k in NAMES}
            args["z"] = rt.from_numpy(np.concatenate([junk[:, :3], step["z"], junk[:, 3:]], axis=1))
            bc = rt.from_numpy(np.concatenate([junk[:, :1], step["B"], junk[:, 1:2], step["C"]], axis=1))
            args["B"] = args["C"] = bc
            y = selective_scan_step(state, *(args[k] for k in NAMES), z_start=3, b_start=1, c_start=nstate + 2)
        assert rel_err(y.numpy(), want[:, t]) < 1e-5
    with pytest.raises(ShapeError, match="z columns"):
        selective_scan_step(state, *(rt.from_numpy(step[k]) for k in NAMES), z_start=1)
    with pytest.raises(ShapeError, match="together"):
        selective_scan_step(state, *(rt.from_numpy(step[k]) for k in NAMES), b_start=0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("batch,length,channels,nstate,chunk,segment", [
    (2, 37, 5, 16, 8, 1),     # one tile / chunk per dispatch, L not a multiple of the tile
    (1, 50, 3, 128, 16, 3),   # N = 128: one channel per workgroup, tiles of 4
    (2, 37, 11, 9, 8, 2),     # channels padded to two subgroups, N not a multiple of 4
])
def test_segmented_matches_one_dispatch(rt, path, batch, length, channels, nstate, chunk, segment):
    """The dispatch segments that Mesa llvmpipe's loop budget needs (h carried in last_state; the adjoint and the
    parameter sums in a carry buffer) give bit-identical results to one dispatch, and match the reference."""
    skip_unsupported(rt, nstate, path)
    x = make_inputs(batch, length, channels, nstate, seed=6)
    dy = np.random.default_rng(7).standard_normal((batch, length, channels)).astype(np.float32)
    args = [rt.from_numpy(x[k]) for k in NAMES]
    per = 2 if path == "direct" else None  # the carry of several channels per invocation
    y1, s1 = selective_scan(*args, chunk=chunk, segment=10**6, path=path)
    g1 = selective_scan_backward(s1, rt.from_numpy(dy), segment=10**6, path=path, per_thread=per)
    y2, s2 = selective_scan(*args, chunk=chunk, segment=segment, path=path)
    g2 = selective_scan_backward(s2, rt.from_numpy(dy), segment=segment, path=path, per_thread=per)
    assert np.array_equal(y1.numpy(), y2.numpy())
    assert np.array_equal(s1.last_state.numpy(), s2.last_state.numpy())
    assert np.array_equal(s1.states.numpy(), s2.states.numpy())
    for name, a, b in zip(GRADS, g1, g2):
        assert np.array_equal(a.numpy(), b.numpy()), name
    y_ref, grads_ref = reference(x, dy)
    assert rel_err(y2.numpy(), y_ref) < 1e-4
    for name, got, want in zip(GRADS, g2, grads_ref):
        assert rel_err(got.numpy(), want) < 1e-4, name
