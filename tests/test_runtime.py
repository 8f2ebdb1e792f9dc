"""The runtime: adapter choice, pipelines for every WGSL entry point, batching, and errors before dispatch."""

import numpy as np
import pytest

from mambactl.errors import MambactlError, ShapeError
from mambactl.ops import activations, linear
from mambactl.runtime import device
from mambactl.runtime.gpu import DISPATCHES_PER_SUBMIT, FIRST_SUBMIT, get_runtime
from mambactl.runtime.kernels import all_modules, entry_point, parse_module


@pytest.fixture(scope="module")
def rt():
    return get_runtime()


def test_every_entry_point_compiles_and_builds_its_pipeline(rt):
    entries = [ep for m in all_modules().values() for ep in m.entries.values()]
    assert len(entries) >= 20
    for ep in entries:
        if not set(ep.features) <= set(rt.features):
            with pytest.raises(MambactlError, match=f"{ep.name} needs the adapter feature"):
                rt.pipeline(ep.name)
            continue
        pipe, layout, got = rt.pipeline(ep.name)
        assert pipe is not None and got.name == ep.name


def test_subgroup_functions_are_left_out_where_the_device_lacks_the_feature():
    """naga validates a whole module against the device's features, so the runtime compiles a module without
    the functions that use subgroup operations (directly or through a helper) where `subgroup` is missing."""
    mod = parse_module(
        "t",
        """
        @group(0) @binding(0) var<storage, read_write> y: array<f32>;
        fn lanes(v: f32) -> f32 { return subgroupBroadcast(v, 1u); }
        fn twice(v: f32) -> f32 { return 2.0 * v; }
        @compute @workgroup_size(8)
        fn shared(@builtin(local_invocation_index) i: u32) { y[i] = lanes(twice(y[i])); }
        @compute @workgroup_size(1)
        fn probe(@builtin(subgroup_size) n: u32) { y[0] = f32(n); }
        @compute @workgroup_size(8)
        fn plain(@builtin(local_invocation_index) i: u32) { y[i] = twice(y[i]); }
        """,
    )
    assert mod.entries["shared"].features == ("subgroup",) and mod.entries["probe"].features == ("subgroup",)
    assert mod.entries["plain"].features == ()
    stripped = mod.source_for(())
    assert "subgroup" not in stripped and "fn plain" in stripped and "fn twice" in stripped
    assert mod.source_for(("subgroup",)) == mod.source


def test_subgroup_size_is_measured(rt):
    """0 without the feature; lavapipe on 256-bit vectors runs 8 lanes (what matmul_subgroup needs)."""
    if "subgroup" not in rt.features:
        assert rt.subgroup_size == 0
        return
    assert rt.subgroup_size in (1, 2, 4, 8, 16, 32, 64, 128)
    if "llvmpipe" in rt.info.name and "256 bits" in rt.info.name:
        assert rt.subgroup_size == 8


def test_a_module_extends_another_and_names_its_features():
    """linear_f16.wgsl: `enable f16;` then linear.wgsl's code then its own; only its own entry points."""
    mod = all_modules()["linear_f16"]
    assert set(mod.entries) == {"matmul_f16", "operand_amax"}
    assert all(ep.features == ("shader-f16",) for ep in mod.entries.values())
    assert mod.source.startswith("enable f16;") and "fn fetch_a(" in mod.source
    assert entry_point("matmul").module == "linear"


def test_layout_lists_only_the_bindings_an_entry_uses():
    mod = parse_module(
        "t",
        """
        struct Params { n: u32 }
        @group(0) @binding(0) var<uniform> p: Params;
        @group(0) @binding(1) var<storage, read> x: array<f32>;
        @group(0) @binding(2) var<storage, read_write> y: array<f32>;
        @group(0) @binding(3) var<storage, read_write> unused: array<f32>;
        fn helper(i: u32) -> f32 { return x[i]; }
        @compute @workgroup_size(1)
        fn main(@builtin(global_invocation_id) gid: vec3<u32>) { if (gid.x < p.n) { y[gid.x] = helper(gid.x); } }
        """,
    )
    ep = mod.entries["main"]
    assert [(b.number, b.name, b.kind) for b in ep.bindings] == [(0, "p", "uniform"), (1, "x", "read"), (2, "y", "read_write")]
    assert ep.params == (("n", "u32"),)


def test_a_texture_global_is_a_texture_binding():
    mod = parse_module(
        "t",
        """
        @group(0) @binding(0) var<storage, read_write> y: array<f32>;
        @group(0) @binding(3) var x_tex: texture_2d<f32>;
        @compute @workgroup_size(1)
        fn main(@builtin(global_invocation_id) gid: vec3<u32>) { y[gid.x] = textureLoad(x_tex, vec2<u32>(gid.x, 0u), 0).x; }
        """,
    )
    assert [(b.number, b.name, b.kind) for b in mod.entries["main"].bindings] == [(0, "y", "read_write"), (3, "x_tex", "texture")]


def test_a_texture_is_copied_again_only_after_its_tensor_is_written(rt, rng, monkeypatch):
    """A tensor read through a texture (cross_entropy's per-row kernels, on any adapter when forced) is copied into
    it before the first dispatch, not again while nothing wrote it, and again after a host write, a buffer copy into
    it and a dispatch that writes it; every result matches its inputs at that point."""
    from mambactl.ops import cross_entropy

    copies = []
    record = rt._record
    monkeypatch.setattr(rt, "_record", lambda cmd: (copies.append(cmd[0] == "texture"), record(cmd)))

    def lse_now(logits, expected_copies):
        copies.clear()
        _, lse = cross_entropy.cross_entropy(logits, targets, 6, rows_path=True)
        got = lse.numpy()
        assert sum(copies) == expected_copies
        ref = logits.numpy().astype(np.float64)
        np.testing.assert_allclose(got, np.log(np.exp(ref).sum(axis=1)), rtol=1e-5)

    targets = rt.from_numpy(rng.integers(0, 9, 6).astype(np.int32))
    logits = rt.from_numpy(rng.standard_normal((6, 9)).astype(np.float32))
    lse_now(logits, 1)
    lse_now(logits, 0)
    rt.write(logits, rng.standard_normal((6, 9)).astype(np.float32))
    lse_now(logits, 1)
    rt.copy(rt.from_numpy(rng.standard_normal((6, 9)).astype(np.float32)), logits)
    lse_now(logits, 1)
    x, w = (rt.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in ((6, 4), (9, 4)))
    linear.matmul(x, w, trans_b=True, out=logits)  # a dispatch adding into it
    lse_now(logits, 1)
    lse_now(logits, 0)


def test_a_local_named_like_a_binding_is_not_a_use_of_it():
    """A parameter or let / var named like a binding (here q and k) shadows it: the entry that never touches the
    buffers q and k must not list them (a dispatch that does not pass them would fail), while one that does
    use the global q lists it."""
    mod = parse_module(
        "t",
        """
        @group(0) @binding(0) var<storage, read> q: array<f32>;
        @group(0) @binding(1) var<storage, read> k: array<f32>;
        @group(0) @binding(2) var<storage, read_write> y: array<f32>;
        fn rotate(q: f32, s: f32) -> f32 { let k = q * s; var v = k; return v; }
        @compute @workgroup_size(1)
        fn local_only(@builtin(global_invocation_id) gid: vec3<u32>) { let q = y[gid.x]; y[gid.x] = rotate(q, 2.0); }
        @compute @workgroup_size(1)
        fn reads_q(@builtin(global_invocation_id) gid: vec3<u32>) { y[gid.x] = rotate(q[gid.x], 2.0); }
        """,
    )
    assert [b.name for b in mod.entries["local_only"].bindings] == ["y"]
    assert [b.name for b in mod.entries["reads_q"].bindings] == ["q", "y"]


def test_best_adapter_is_ranked_and_devices_are_listed():
    infos = device.list_adapters()
    assert infos, "this machine should have at least a software adapter"
    _, best = device.choose_adapter()
    assert device._rank(best) == min(device._rank(i) for i in infos)
    for info in infos:
        assert info.limits["max-storage-buffer-binding-size"] > 0


def test_device_spec_by_index_name_and_env(monkeypatch):
    infos = device.list_adapters()
    _, by_index = device.choose_adapter("0")
    assert by_index.index == 0
    _, by_name = device.choose_adapter(infos[-1].name[:6] + "/" + infos[-1].backend)
    assert by_name.backend == infos[-1].backend
    monkeypatch.setenv("MAMBACTL_DEVICE", str(len(infos) - 1))
    assert device.choose_adapter()[1].index == len(infos) - 1
    with pytest.raises(MambactlError, match="does not exist"):
        device.choose_adapter("99")
    with pytest.raises(MambactlError, match="no adapter matches"):
        device.choose_adapter("no-such-gpu")


def test_device_gets_the_adapters_real_limits(rt):
    for key in ("max-storage-buffer-binding-size", "max-buffer-size", "max-compute-workgroup-storage-size"):
        assert rt.limits[key] == rt.adapter.limits[key]


def test_ops_are_recorded_and_submitted_together(rt):
    x = rt.from_numpy(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
    x.numpy()  # a read: the next batch is FIRST_SUBMIT dispatches
    before = rt.submits
    y = x
    for _ in range(FIRST_SUBMIT - 1):
        y = activations.silu(y)
    assert rt.submits == before, "recording must not submit"
    y.numpy()
    assert rt.submits == before + 1


def test_a_batch_cut_short_by_a_write_sets_the_next_batch_by_its_own_length(rt):
    # A training step starts with one dispatch (zeroing the gradients) and then uploads the token ids: the next
    # batch must not double from the batch size that was allowed, or the GPU waits for twice as many dispatches.
    host = np.arange(16, dtype=np.float32)
    x, other = rt.from_numpy(host), rt.from_numpy(host)
    x.numpy()
    y = activations.add(x, x)  # one dispatch, then a write cuts the batch short
    rt.write(other, host + 1)
    before = rt.submits
    for i in range(FIRST_SUBMIT):
        assert rt.submits == before, "the next batch is FIRST_SUBMIT dispatches, not twice the allowed size"
        y = activations.add(y, other)
    assert rt.submits == before + 1
    np.testing.assert_array_equal(y.numpy(), 2 * host + FIRST_SUBMIT * (host + 1))


def test_long_recordings_are_submitted_in_growing_batches_with_the_same_result(rt):
    host = np.random.default_rng(1).standard_normal(300).astype(np.float32)
    x = rt.from_numpy(host)
    x.numpy()  # a read: the next batch is FIRST_SUBMIT dispatches, then each twice the last, up to the cap
    before = rt.submits
    n = 3 * DISPATCHES_PER_SUBMIT + 5
    batches, size, left = [], FIRST_SUBMIT, n
    while left >= size:
        batches.append(size)
        left -= size
        size = min(DISPATCHES_PER_SUBMIT, 2 * size)
    assert batches[-1] == DISPATCHES_PER_SUBMIT and left > 0
    y = x
    for i in range(n):  # the chain crosses every submit boundary: the result shows the batches ran in order
        y = activations.add(y, x)
        if i + 1 == batches[0]:
            assert rt.submits == before + 1, "the first batch after a read is FIRST_SUBMIT dispatches"
    got = y.numpy()
    assert rt.submits == before + len(batches) + 1  # the full batches while recording, the rest on the read
    want = host.copy()
    for _ in range(n):  # float32 adds round the same way on the host
        want = want + host
    np.testing.assert_array_equal(got, want)


def test_a_repeated_step_binds_the_same_pooled_buffers_and_creates_no_bind_groups(rt):
    host = np.random.default_rng(2).standard_normal((33, 20)).astype(np.float32)
    w = rt.from_numpy(np.random.default_rng(3).standard_normal((7, 20)).astype(np.float32))

    def step():
        x = rt.from_numpy(host)
        h = activations.silu(linear.linear(x, w))
        t = activations.add(h, h)
        del h  # released in another order than acquired: the pool still hands out the same buffers
        return t.numpy()

    first = step()
    step()
    cached = len(rt._bind_groups)
    for _ in range(3):
        np.testing.assert_array_equal(step(), first)
    assert len(rt._bind_groups) == cached


def test_a_captured_graph_replays_its_work_on_new_inputs(rt):
    rng = np.random.default_rng(4)
    w = rt.from_numpy(rng.standard_normal((7, 20)).astype(np.float32))
    x = rt.from_numpy(np.zeros((5, 20), np.float32))
    acc = rt.from_numpy(np.zeros((5, 7), np.float32))
    with rt.capture() as graph:  # a dispatch chain, a copy, and state updated in place
        h = activations.silu(linear.linear(x, w))
        t = activations.add(h, acc)
        rt.copy(t, acc)
    assert graph.commands and any(c[0] == "copy" for c in graph.commands)
    want_acc = np.zeros((5, 7))
    wn = w.numpy().astype(np.float64)
    for _ in range(3):
        host = rng.standard_normal((5, 20)).astype(np.float32)
        rt.write(x, host)
        rt.replay(graph)
        z = host.astype(np.float64) @ wn.T
        want_acc = want_acc + z / (1 + np.exp(-z))
        np.testing.assert_allclose(acc.numpy(), want_acc, rtol=1e-5, atol=1e-5)


def test_a_replayed_graph_is_profiled_like_recorded_work(rt):
    x = rt.from_numpy(np.ones(64, np.float32))
    with rt.capture() as graph:
        y = activations.silu(activations.add(x, x))
    rt.sync()  # the captured block itself ran as recorded work
    rt.gpu_times = []
    try:
        rt.replay(graph)
        got = y.numpy()
        entries = [entry for entry, _, _ in rt.gpu_times]
    finally:
        rt.gpu_times = None
    assert [e for e in entries if e != "fill"] == ["add_forward", "silu_forward"] or "timestamp-query" not in rt.features
    np.testing.assert_allclose(got, 2 / (1 + np.exp(-2.0)), rtol=1e-6)


def test_capture_refuses_host_transfers_and_nesting(rt):
    x = rt.from_numpy(np.ones(8, np.float32))
    for what, call in (("write", lambda: rt.write(x, np.zeros(8, np.float32))), ("read", lambda: x.numpy()),
                       ("fill", lambda: rt.fill(x, 0.0))):
        with pytest.raises(MambactlError, match="cannot be captured"), rt.capture():
            activations.silu(x)
            call()
    with pytest.raises(MambactlError, match="already capturing"), rt.capture(), rt.capture():
        pass
    np.testing.assert_array_equal(x.numpy(), np.ones(8, np.float32))  # the runtime works on after a refusal


def test_shape_and_dtype_errors_name_the_op_and_tensor_before_dispatch(rt):
    a = rt.from_numpy(np.ones((3, 4), np.float32))
    b = rt.from_numpy(np.ones((5, 6), np.float32))
    ids = rt.from_numpy(np.ones(3, np.int32))
    rt.flush()
    pending = len(rt._pending)
    with pytest.raises(ShapeError, match=r"linear: w has shape \(5, 6\), expected \(\*, 4\)"):
        linear.linear(a, b)
    with pytest.raises(ShapeError, match="silu_forward: x has dtype int32"):
        activations.silu(ids)
    with pytest.raises(ShapeError, match="add_forward: b has shape"):
        activations.add(a, b)
    assert len(rt._pending) == pending, "nothing may be recorded for a rejected call"


def test_tensor_over_the_binding_limit_is_refused_before_dispatch(rt):
    n = rt.max_binding // 4 + 1
    if n * 4 > rt.limits["max-buffer-size"]:
        pytest.skip("the adapter's buffer limit equals its binding limit")
    big = rt.empty((n,))
    with pytest.raises(ShapeError, match=r"silu_forward: tensor 'x' .* over this device's storage binding limit"):
        activations.silu(big)


def test_reshape_is_a_view(rt):
    t = rt.from_numpy(np.arange(12, dtype=np.float32))
    v = t.reshape(3, -1)
    assert v.shape == (3, 4) and v.buffer is t.buffer
    np.testing.assert_array_equal(v.numpy(), np.arange(12).reshape(3, 4))


def test_a_tensor_collected_in_a_reference_cycle_returns_a_live_buffer(rt):
    """The cycle collector finalizes a cycle's objects in no set order: the tensor's buffer must not be released by
    wgpu before the tensor hands it back to the pool (an exception's traceback holding tensors makes such cycles)."""
    import gc

    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            box = {"t": rt.from_numpy(np.ones(1000, np.float32))}
            box["self"] = box  # a cycle holding the tensor
            del box
        gc.collect()
    finally:
        gc.enable()
    got = [rt.from_numpy(np.full(1000, i, np.float32)).numpy()[0] for i in (1, 2, 3)]  # the pool's buffers of that size
    assert got == [1.0, 2.0, 3.0]


def test_pool_reuses_buffers(rt):
    t = rt.empty((1000,))
    buf = t.buffer
    del t
    assert rt.empty((1000,)).buffer is buf


def test_gpu_times_label_every_dispatch_with_its_timestamps(rt):
    if "timestamp-query" not in rt.features:
        pytest.skip("the adapter has no timestamp queries")
    x = rt.from_numpy(np.random.default_rng(4).standard_normal(4096).astype(np.float32))
    rt.gpu_times = []
    try:
        y = activations.add(activations.silu(x), x)
        want = y.numpy()
        times = list(rt.gpu_times)
    finally:
        rt.gpu_times = None
    assert [entry for entry, _, _ in times] == ["silu_forward", "add_forward"]
    assert all(ns > 0 for _, _, ns in times)
    xs = x.numpy().astype(np.float64)
    np.testing.assert_allclose(want, xs / (1 + np.exp(-xs)) + xs, rtol=1e-5, atol=1e-6)  # timed passes still compute


def test_a_checkout_first_on_sys_path_runs_its_own_kernels(tmp_path):
    """bench/gemm.py --src OTHER and device snapshots import another tree's mambactl: its WGSL must come with it,
    not from wherever mambactl is installed."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    shutil.copytree(repo / "mambactl", tmp_path / "mambactl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(repo / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    code = "from mambactl.runtime.kernels import kernel_dir; print(kernel_dir())"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert Path(out.stdout.strip()) == tmp_path / "kernels"


def test_arena_views_bind_at_their_offsets(rt):
    """Arena views: aligned starts, zero gaps, host reads and writes and kernels (silu) at the view's offset touch
    only its elements; spans merge neighbours into one view and keep the others apart."""
    from mambactl.ops import activations
    from mambactl.runtime.arena import ALIGN, Arena, spans

    shapes = [(3,), (70, 2), (1,), (5, 5)]
    arena = Arena(rt, shapes)
    views = arena.tensors
    assert len(arena.chunks) == 1 and all(v.offset % ALIGN == 0 and v.shape == s for v, s in zip(views, shapes))
    data = [np.arange(v.size, dtype=np.float32).reshape(v.shape) + 10 * k + 1 for k, v in enumerate(views)]
    for v, d in zip(views, data):
        rt.write(v, d)
    for v, d in zip(views, data):
        np.testing.assert_array_equal(v.numpy(), d)
    y = activations.silu(views[1])  # a kernel reading a view at an offset
    np.testing.assert_allclose(y.numpy(), data[1] / (1 + np.exp(-data[1].astype(np.float64))), rtol=1e-6)
    flat = arena.chunks[0].numpy()
    inside = np.zeros(flat.size, bool)
    for v in views:
        inside[v.offset // 4:v.offset // 4 + v.size] = True
    assert not np.any(flat[~inside])
    merged = spans(views)
    assert len(merged) == 1 and merged[0][0] == 0 and merged[0][1][0].size == views[-1].offset // 4 + 64  # whole slots
    loose = [rt.from_numpy(d) for d in data]
    assert [first for first, _ in spans(views[::-1], keys=[0, 0, 1, 1])] == [3, 1]  # in layout order
    assert [first for first, _ in spans(loose)] == [0, 1, 2, 3]


@pytest.mark.parametrize("given", [None, "3"])
def test_software_adapter_threads_default_to_twice_the_cores(given):
    # Mesa's software adapters read LP_NUM_THREADS when the adapters are enumerated; a value the user set wins.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "LP_NUM_THREADS"}
    if given is not None:
        env["LP_NUM_THREADS"] = given
    code = ("import os; from mambactl.runtime import device; device._enumerate(); "
            "print(os.environ['LP_NUM_THREADS'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == (given or str(2 * (os.cpu_count() or 1)))


def test_modules_compile_with_and_without_wgpus_runtime_checks(rt, monkeypatch):
    """Modules are compiled without wgpu's index clamps and loop counters (SHADER_RUNTIME_CHECKS = 0); with the
    checks back on (a fresh Runtime, so nothing is cached) the same kernels give the same bits on ragged shapes
    (edge tiles, K not a multiple of the tile), and a module that does not compile still fails with its name."""
    from mambactl.runtime import gpu

    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((37, 70)).astype(np.float32), rng.standard_normal((45, 70)).astype(np.float32)
    results = []
    for checks, runtime in ((0, rt), (1, None)):
        monkeypatch.setattr(gpu, "SHADER_RUNTIME_CHECKS", checks)
        runtime = runtime or gpu.Runtime()
        y = linear.linear(runtime.from_numpy(x), runtime.from_numpy(w))
        results.append(runtime.read(y))
        with pytest.raises(Exception, match="broken"):
            gpu._shader_module(runtime.device, "broken", "@compute @workgroup_size(1) fn main() { let a = b; }", checks)
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_allclose(results[0], x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-4)
