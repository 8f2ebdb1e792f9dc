"""GPU AdamW (mambactl/ops/adamw.py) against its float64 CPU mirror (mambactl/reference/adamw.py).

Errors are relative per tensor: max|gpu − mirror| / max|mirror|, and must stay under 1e-5 for the
parameters and both moments; the mirror runs its own float64 trajectory from the same float32 start.
"""

import math

import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.ops.adamw import STATE_FIELDS, AdamWState, adamw_step
from mambactl.ops.checks import is_cpu
from mambactl.reference import adamw as ref
from mambactl.runtime.arena import arena_chunk

TOL = 1e-5
SHAPES = [(1,), (3,), (17,), (5, 13), (1000,)]
NO_DECAY = [True, False, True, False, False]
GRAD_SCALES = [1.0, 0.3, 5.0, 1e-3, 0.05]  # tensors of very different gradient size
BAD = [(2, 5), (4, 100)]  # (tensor, flat element) where faults are planted


def rel_err(gpu, want) -> float:
    return float(np.max(np.abs(gpu - want)) / max(np.max(np.abs(want)), 1e-30))


class Mirror:
    """The reference optimizer over a list of float64 tensors, with the step-level guard of adamw_step."""

    def __init__(self, params, m=None, v=None, t=0):
        self.p = [np.asarray(a, np.float64) for a in params]
        self.m = [np.zeros_like(a) for a in self.p] if m is None else [np.asarray(a, np.float64) for a in m]
        self.v = [np.zeros_like(a) for a in self.p] if v is None else [np.asarray(a, np.float64) for a in v]
        self.t = t

    def step(self, grads, *, lr, beta1, beta2, eps, weight_decay, no_decay, max_grad_norm, max_delta,
             guard_norm=True) -> int:
        with np.errstate(over="ignore", invalid="ignore"):
            norm = math.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in grads))
        if not math.isfinite(norm):
            if guard_norm:
                return 0
            scale = 1.0
        else:
            scale = ref.clip_scale(norm, max_grad_norm)
        self.t += 1
        bad = 0
        for i, g in enumerate(grads):
            wd = 0.0 if no_decay[i] else weight_decay
            self.p[i], self.m[i], self.v[i], n = ref.adamw_step(
                self.p[i], g, self.m[i], self.v[i], step=self.t, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=wd, grad_scale=scale, max_delta=max_delta)
            bad += n
        return bad


def setup(rt, seed=0):
    rng = np.random.default_rng(seed)
    host = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    params = [rt.from_numpy(a) for a in host]
    return rng, host, params, AdamWState.zeros(params)


def random_grads(rng):
    return [(rng.normal(size=s) * k).astype(np.float32) for s, k in zip(SHAPES, GRAD_SCALES)]


def check_against(mirror, params, state, skip=()):
    """Max relative error over params, m, v of every tensor (elements in `skip` left out)."""
    worst = 0.0
    for i, p in enumerate(params):
        for gpu, want in ((p.numpy(), mirror.p[i]), (state.m[i].numpy(), mirror.m[i]), (state.v[i].numpy(), mirror.v[i])):
            gpu, want = gpu.ravel().astype(np.float64), want.ravel().copy()
            for ti, e in skip:
                if ti == i:
                    gpu[e] = want[e] = 0.0
            worst = max(worst, rel_err(gpu, want))
    return worst


def snapshot(params, state):
    return [p.numpy() for p in params], [a.numpy() for a in state.m], [a.numpy() for a in state.v]


@pytest.fixture(params=["textures", "buffers"])
def reads(request, rt, monkeypatch):
    """CPU adapters read the update's four operands through textures where they fit; "buffers" takes the buffer
    kernel there too (the one GPUs run), so both are checked on every adapter that has both."""
    if request.param == "textures" and not is_cpu(rt):
        pytest.skip("textures are read on CPU adapters only")
    if request.param == "buffers":
        monkeypatch.setattr(rt, "fits_texture", lambda *tensors: False)
    return request.param


HP = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, no_decay=NO_DECAY)
LRS = [1e-2, 8e-3, 6e-3, 4e-3, 2e-3]


@pytest.mark.parametrize("max_grad_norm,max_delta,beta2", [
    (1.0, 5e-3, 0.999),   # clipping and trust region both active
    (0.0, 0.0, 0.999),    # clipping disabled
    (1e3, 0.0, 0.95),     # clipping enabled but not binding
])
def test_matches_mirror_over_steps(rt, reads, max_grad_norm, max_delta, beta2):
    rng, host, params, state = setup(rt)
    hp = dict(HP, beta2=beta2, max_grad_norm=max_grad_norm, max_delta=max_delta)
    mirror = Mirror(host)
    clamped = []
    for lr in LRS:
        grads = random_grads(rng)
        before = params[4].numpy()
        adamw_step(params, [rt.from_numpy(g) for g in grads], state, lr=lr, **hp)
        mirror.step(grads, lr=lr, **hp)
        delta = before * np.float32(1 - lr * 0.1) - params[4].numpy()
        clamped.append(np.mean(np.abs(delta) > max_delta * (1 - 1e-4)) if max_delta else 0.0)
        assert check_against(mirror, params, state) < TOL
    counters = state.read_counters()
    norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads))
    assert counters["step"] == len(LRS) and counters["skipped_steps"] == 0 and counters["bad_elements"] == 0
    assert abs(counters["grad_norm"] - norm) < 1e-5 * norm
    if max_grad_norm:
        assert (norm > max_grad_norm) == (max_grad_norm == 1.0)  # the case meant to clip really clips
    if max_delta:
        assert 0.05 < np.mean(clamped) < 0.95  # the trust region binds some elements, not all


@pytest.mark.parametrize("fault", ["nan", "inf", "both"])
def test_non_finite_norm_skips_whole_step(rt, fault):
    rng, host, params, state = setup(rt, seed=1)
    hp = dict(HP, max_grad_norm=1.0, max_delta=0.0)
    mirror = Mirror(host)
    for k, lr in enumerate(LRS):
        grads = random_grads(rng)
        if k == 2:
            (ti, e), (tj, f) = BAD
            if fault in ("nan", "both"):
                grads[ti].ravel()[e] = np.nan
            if fault in ("inf", "both"):
                grads[tj].ravel()[f] = -np.inf
            before = snapshot(params, state)
        adamw_step(params, [rt.from_numpy(g) for g in grads], state, lr=lr, **hp)
        mirror.step(grads, lr=lr, **hp)
        if k == 2:
            after = snapshot(params, state)
            for x, y in zip(sum(before, []), sum(after, [])):
                assert np.array_equal(x, y)  # weights and moments untouched, bit for bit
            c = state.read_counters()
            assert (c["step"], c["skipped_steps"], c["bad_elements"]) == (2, 1, 0)
            assert not math.isfinite(c["grad_norm"])
        assert check_against(mirror, params, state) < TOL  # later steps use t = 3, 4: skips don't advance t
    assert state.read_counters()["step"] == len(LRS) - 1 == mirror.t


def test_element_guard_without_norm_guard(rt):
    """guard_norm=False: a NaN and an Inf gradient element freeze only their own weight and moments."""
    rng, host, params, state = setup(rt, seed=2)
    hp = dict(HP, max_grad_norm=1.0, max_delta=0.0, guard_norm=False)
    mirror = Mirror(host)
    for k, lr in enumerate(LRS):
        grads = random_grads(rng)
        if k == 2:
            (ti, e), (tj, f) = BAD
            grads[ti].ravel()[e], grads[tj].ravel()[f] = np.nan, np.inf
            before = snapshot(params, state)
        adamw_step(params, [rt.from_numpy(g) for g in grads], state, lr=lr, **hp)
        n_bad = mirror.step(grads, lr=lr, **hp)
        if k == 2:
            assert n_bad == 2
            after = snapshot(params, state)
            for ti_, e_ in BAD:
                for x, y in zip(before, after):
                    assert x[ti_].ravel()[e_] == y[ti_].ravel()[e_]  # weight, m, v all unchanged
            assert state.read_counters()["bad_elements"] == 2
            assert check_against(mirror, params, state, skip=BAD) < TOL
            continue
        # Later steps update the guarded elements again (the old engine froze them with NaN moments).
        assert check_against(mirror, params, state) < TOL
    c = state.read_counters()
    assert (c["step"], c["skipped_steps"], c["bad_elements"]) == (len(LRS), 0, 2)


def test_element_guard_with_finite_norm(rt, reads):
    """With the norm guard on and clipping active, non-finite moments (e.g. a corrupt checkpoint) are caught
    per element: the step goes ahead, those elements keep their values and are counted."""
    rng, host, params, state = setup(rt, seed=3)
    hp = dict(HP, max_grad_norm=1.0, max_delta=5e-3)
    mirror = Mirror(host)
    for lr in LRS[:2]:
        grads = random_grads(rng)
        adamw_step(params, [rt.from_numpy(g) for g in grads], state, lr=lr, **hp)
        mirror.step(grads, lr=lr, **hp)
    saved = state.to_numpy()
    (ti, e), (tj, f) = BAD
    saved[f"m.{ti}"].ravel()[e] = np.nan
    saved[f"v.{tj}"].ravel()[f] = np.inf
    state = AdamWState.from_numpy(rt, saved)
    mirror.m[ti].ravel()[e], mirror.v[tj].ravel()[f] = np.nan, np.inf
    before = snapshot(params, state)
    grads = random_grads(rng)
    adamw_step(params, [rt.from_numpy(g) for g in grads], state, lr=LRS[2], **hp)
    assert mirror.step(grads, lr=LRS[2], **hp) == 2
    after = snapshot(params, state)
    for ti_, e_ in BAD:
        for x, y in zip(before, after):
            assert np.array_equal(x[ti_].ravel()[e_], y[ti_].ravel()[e_], equal_nan=True)
    assert check_against(mirror, params, state, skip=BAD) < TOL
    c = state.read_counters()
    assert (c["step"], c["skipped_steps"], c["bad_elements"]) == (3, 0, 2) and c["grad_norm"] > 1.0


def test_nan_step_survives_trust_region(rt):
    """eps = 0 and a zero gradient give step = 0/0 = NaN from finite moments: the trust region's clamp must not
    turn it into ±max_delta; the element is guarded like any other."""
    g = np.array([0.0, 1.0, -2.0], np.float32)
    params = [rt.from_numpy(np.array([0.5, 0.5, 0.5], np.float32))]
    state, mirror = AdamWState.zeros(params), Mirror([np.array([0.5, 0.5, 0.5])])
    hp = dict(HP, eps=0.0, no_decay=[False], max_grad_norm=0.0, max_delta=1e-3)
    adamw_step(params, [rt.from_numpy(g)], state, lr=1e-2, **hp)
    assert mirror.step([g], lr=1e-2, **hp) == 1
    assert params[0].numpy()[0] == np.float32(0.5) and state.read_counters()["bad_elements"] == 1
    assert check_against(mirror, params, state) < TOL


def test_long_run_bias_correction(rt):
    """After 300 steps with β2 = 0.999 the GPU's 1 − β^t recurrence still matches float64 powers, and a step
    from the GPU's own state matches the mirror's step t = 301 (the two trajectories' float32-vs-float64
    drift is not what this checks)."""
    rng = np.random.default_rng(4)
    params = [rt.from_numpy(rng.normal(size=17).astype(np.float32))]
    state = AdamWState.zeros(params)
    hp = dict(HP, no_decay=[False], max_grad_norm=0.0, max_delta=0.0)
    for _ in range(300):
        adamw_step(params, [rt.from_numpy((rng.normal(size=17) * 1e-2 + 3e-3).astype(np.float32))], state,
                   lr=1e-3, **hp)
    bc = state.counters.numpy()[5:7].view(np.float32).astype(np.float64)
    want = np.array([1 - 0.9**300, 1 - 0.999**300])
    assert np.max(np.abs(bc - want) / want) < 1e-6
    mirror = Mirror(*snapshot(params, state), t=300)
    grads = [(rng.normal(size=17) * 1e-2 + 3e-3).astype(np.float32)]
    adamw_step(params, [rt.from_numpy(grads[0])], state, lr=1e-3, **hp)
    mirror.step(grads, lr=1e-3, **hp)
    assert check_against(mirror, params, state) < TOL


def test_checkpoint_round_trip_is_bitwise(rt):
    rng, host, params, state = setup(rt, seed=5)
    hp = dict(HP, max_grad_norm=1.0, max_delta=5e-3)
    grads = [random_grads(rng) for _ in range(4)]
    for g in grads[:2]:
        adamw_step(params, [rt.from_numpy(x) for x in g], state, lr=1e-2, **hp)
    saved, saved_params = state.to_numpy(), [p.numpy() for p in params]
    assert set(saved) == {"counters"} | {f"{k}.{i}" for k in "mv" for i in range(len(SHAPES))}
    assert saved["counters"].shape == (len(STATE_FIELDS),)
    resumed_params = [rt.from_numpy(p) for p in saved_params]
    resumed = AdamWState.from_numpy(rt, saved)
    for g in grads[2:]:
        adamw_step(params, [rt.from_numpy(x) for x in g], state, lr=1e-2, **hp)
        adamw_step(resumed_params, [rt.from_numpy(x) for x in g], resumed, lr=1e-2, **hp)
    for x, y in zip(sum(snapshot(params, state), []), sum(snapshot(resumed_params, resumed), [])):
        assert np.array_equal(x, y)
    assert np.array_equal(state.counters.numpy(), resumed.counters.numpy())


def test_step_reads_nothing_back(rt, monkeypatch):
    """The clip norm and the NaN/Inf guard stay on the GPU: no host round trip (a read, which a sync is too)."""
    rng, host, params, state = setup(rt, seed=6)
    grads = [rt.from_numpy(g) for g in random_grads(rng)]
    rt.subgroup_size  # the ops' one probe that reads back, once per runtime
    reads = []
    real_read = rt.read
    monkeypatch.setattr(rt, "read", lambda t: reads.append(t) or real_read(t))
    adamw_step(params, grads, state, lr=1e-2, **HP, max_grad_norm=1.0, max_delta=0.0)
    assert reads == []
    monkeypatch.undo()
    assert state.read_counters()["step"] == 1


def test_shape_errors(rt):
    rng, host, params, state = setup(rt, seed=7)
    grads = [rt.from_numpy(g) for g in random_grads(rng)]
    with pytest.raises(ShapeError, match=r"grads\[1\]"):
        adamw_step(params, grads[:1] + [grads[2]] + grads[2:], state, lr=1e-2)
    with pytest.raises(ShapeError, match="no_decay"):
        adamw_step(params, grads, state, lr=1e-2, no_decay=[True])
    with pytest.raises(ShapeError, match="grads"):
        adamw_step(params, grads[:-1], state, lr=1e-2)
    with pytest.raises(ShapeError, match="lacks"):
        AdamWState.from_numpy(rt, {"m.0": np.zeros(3, np.float32)})


def test_arena_views_step_in_one_dispatch_per_decay_run(rt, monkeypatch):
    """Parameters, gradients and (by AdamWState.zeros) moments as views of Arenas, decayed tensors first, as
    models/lm.py lays them out: the global norm is one pass-1 dispatch, the update one vec4 dispatch per decay class,
    the gaps between views stay zero, and the trajectory (a planted NaN included) matches the mirror."""
    from mambactl.runtime.arena import Arena

    order = sorted(range(len(SHAPES)), key=lambda i: NO_DECAY[i])
    rng = np.random.default_rng(11)
    host = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    p_arena, g_arena = Arena(rt, [SHAPES[i] for i in order]), Arena(rt, [SHAPES[i] for i in order])
    params, grads = [None] * len(SHAPES), [None] * len(SHAPES)
    for k, i in enumerate(order):
        params[i], grads[i] = p_arena.tensors[k], g_arena.tensors[k]
        rt.write(params[i], host[i])
    state = AdamWState.zeros(params)
    assert all(arena_chunk(m) is not None and m.offset == p.offset for m, p in zip(state.m, params))
    hp = dict(HP, max_grad_norm=1.0, max_delta=5e-3)
    mirror = Mirror(host)
    entries = []
    run = rt.run
    monkeypatch.setattr(rt, "run", lambda entry, *a, **kw: (entries.append(entry), run(entry, *a, **kw))[1])
    for k, lr in enumerate(LRS):
        g = random_grads(rng)
        if k == 1:
            g[BAD[0][0]].ravel()[BAD[0][1]] = np.nan
        for i in range(len(SHAPES)):
            rt.write(grads[i], g[i])
        entries.clear()
        adamw_step(params, grads, state, lr=lr, **dict(hp, guard_norm=False))
        assert entries.count("adamw_update_vec4") == 2 and "adamw_update" not in entries  # spans are whole slots
        assert entries.count("reduce_partial" if "reduce_partial" in entries else "reduce_partial_subgroup") == 1
        mirror.step(g, lr=lr, **dict(hp, guard_norm=False))
    assert check_against(mirror, params, state, skip=[BAD[0]]) < TOL
    assert state.read_counters()["bad_elements"] == 1
    for chunk in p_arena.chunks + g_arena.chunks:  # the gaps between the views are still zero
        flat = chunk.numpy()
        inside = np.zeros(flat.size, bool)
        for t in (p_arena.tensors if chunk in p_arena.chunks else g_arena.tensors):
            inside[t.offset // 4:t.offset // 4 + t.size] = True
        assert not np.any(flat[~inside])
