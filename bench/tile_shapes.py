"""How fast a batch of small GEMM tiles can run, by workgroup shape: the ceiling for the SSD tile engine.

    python bench/tile_shapes.py [--tiles 1536 --rows 64 --cols 128 --k 128] [--configs 64x64/4x4,64x64/8x4,...] [--scale]
        [--repeats 5] [--warm-s 0.5] [--device D] [--out FILE]

Each workgroup computes one TM × TN tile of C[t] = A[t]ᵀ B (A[t] [K, M] k-major, M = --rows and distinct per tile, B
[K, --cols] shared, as ssd_tile's M_STATE reads x and B), stepping K by 16 through double-buffered shared
tiles with one barrier a step, the next step's operands in registers while this one is multiplied (the
engine's scheme; `/late` after a config: loaded after it, linear.wgsl's order; `/ka`, `/kb`: A or B
K-contiguous in memory, staged by transposed scalar stores as ssd_tile stages such operands; a
config whose padded shared rows would pass the 48 KiB of workgroup memory, such as 128x256/8x16, keeps them unpadded
and spreads those stores over the banks by an XOR of the vec4 slot with k / 4). A config `TMxTN/RMxRN` gives the tile and each thread's register block (threads =
TM·TN / (RM·RN)); a thread's rows are RM / 4 vec4s TM / RM rows apart (and likewise its columns), so a warp's
shared reads stay 8 or 4 consecutive vec4s. `--scale` multiplies each staged A row by exp of a per-row value
read from memory (the engine's decay-weighted loaders). Prints TFLOP/s (GPU timestamps around a pass of --per-pass (20)
dispatches where the adapter has them, else wall time around one; median of repeats after --warm-s
seconds of the same dispatches: on the H200 a GPU left idle for a moment, as while numpy checks the last config,
ran the next config's first timings up to 4× slower) and checks every config's C against numpy once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import header, keep_busy  # first: it puts the checkout on sys.path

import numpy as np  # noqa: E402
import wgpu  # noqa: E402

from mambactl.ops.checks import is_cpu  # noqa: E402
from mambactl.runtime.gpu import _shader_module, get_runtime  # noqa: E402

BK = 16


def shader(m_all: int, n_all: int, tm: int, tn: int, rm: int, rn: int, scale: bool, early: bool, a_kc: bool, b_kc: bool) -> tuple[str, int]:
    """WGSL for one config, every per-thread loop written out; returns (source, threads)."""
    txc, tyc = tn // rn, tm // rm
    threads = txc * tyc
    arow, brow = tm // 4 + 1, tn // 4 + 1  # a padding vec4 a row: the transposed stores spread over banks
    swizzle = 2 * 16 * (arow + brow) * 16 > 49152  # over the 48 KiB of workgroup memory: no padding; the
    if swizzle:  # transposed stores spread by an XOR of the vec4 slot with k / 4 instead
        arow, brow = tm // 4, tn // 4
    la, lb = 16 * tm // 4 // threads, 16 * tn // 4 // threads
    assert la >= 1 and lb >= 1 and txc >= 8, (tm, tn, rm, rn)
    qa, qb = rm // 4, rn // 4
    acc = [f"acc{q}_{i}_{j}" for q in range(qa) for i in range(4) for j in range(qb)]
    L = []
    L.append("struct P { k: u32, tiles: u32 }")
    L.append("@group(0) @binding(0) var<uniform> p: P;")
    L.append("@group(0) @binding(1) var<storage, read> a: array<vec4<f32>>;")
    L.append("@group(0) @binding(2) var<storage, read> b: array<vec4<f32>>;")
    L.append("@group(0) @binding(3) var<storage, read_write> c: array<vec4<f32>>;")
    L.append("@group(0) @binding(4) var<storage, read> w: array<f32>;")
    L.append(f"var<workgroup> sa: array<vec4<f32>, {2 * 16 * arow}>;")
    L.append(f"var<workgroup> sb: array<vec4<f32>, {2 * 16 * brow}>;")
    L.append("var<private> tile: u32;")
    L.append("var<private> n0: u32;")
    L.append("var<private> m0: u32;")
    L.append("var<private> tid: u32;")
    L += [f"var<private> la{j}: vec4<f32>;" for j in range(la)]
    L += [f"var<private> lb{j}: vec4<f32>;" for j in range(lb)]
    L += [f"var<private> {x}: vec4<f32>;" for x in acc]
    L.append("fn fetch(k0: u32) {")
    for j in range(la):
        L.append(f"    {{ let v = tid + {j * threads}u;")
        if a_kc:  # A [tiles, M, K]: four k of one row
            L.append("      let row = v / 4u; let k = k0 + (v % 4u) * 4u;")
            ld = f"a[((tile * {m_all}u + m0 + row) * p.k + k) / 4u]"
            if scale:
                ld = (f"{ld} * exp(vec4<f32>(w[tile * p.k + k], w[tile * p.k + k + 1u], w[tile * p.k + k + 2u], "
                      "w[tile * p.k + k + 3u]))")
        else:  # A [tiles, K, M]: four rows at one k
            L.append(f"      let k = k0 + v / {tm // 4}u;")
            ld = f"a[(tile * p.k + k) * {m_all // 4}u + m0 / 4u + v % {tm // 4}u]"
            if scale:
                ld = f"{ld} * exp(w[tile * p.k + k])"
        L.append(f"      la{j} = {ld}; }}")
    for j in range(lb):
        L.append(f"    {{ let v = tid + {j * threads}u;")
        if b_kc:  # B [128, K]
            L.append(f"      lb{j} = b[((n0 + v / 4u) * p.k + k0 + (v % 4u) * 4u) / 4u]; }}")
        else:
            L.append(f"      let k = k0 + v / {tn // 4}u;")
            L.append(f"      lb{j} = b[k * {n_all // 4}u + n0 / 4u + v % {tn // 4}u]; }}")
    L.append("}")
    L.append("fn commit(buf: u32) {")
    for name, count, kc, row, sh in (("la", la, a_kc, arow, "sa"), ("lb", lb, b_kc, brow, "sb")):
        width = (tm if name == "la" else tn) // 4
        for j in range(count):
            L.append(f"    {{ let v = tid + {j * threads}u;")
            if kc:  # transposed: the four k values go to four k rows (ssd_tile's e_commit)
                L.append("      let m = v / 4u; let k = (v % 4u) * 4u;")
                slot = "((m / 4u) ^ (k / 4u))" if swizzle else "m / 4u"
                for c in range(4):
                    L.append(f"      {sh}[(buf * 16u + k + {c}u) * {row}u + {slot}][m % 4u] = {name}{j}[{c}];")
                L.append("    }")
            else:
                L.append(f"      {sh}[(buf * 16u + v / {width}u) * {row}u + v % {width}u] = {name}{j}; }}")
    L.append("}")
    # one k of the register block, called 16 times (as linear.wgsl's kstep: after inlining every shared index but
    # the thread's is a constant)
    L.append("fn kstep(buf: u32, k: u32, tx: u32, ty: u32) {")
    sw_a = " ^ (k / 4u)" if swizzle and a_kc else ""
    sw_b = " ^ (k / 4u)" if swizzle and b_kc else ""
    for q in range(qa):
        L.append(f"    let a{q} = sa[(buf * 16u + k) * {arow}u + ((ty + {q * tyc}u){sw_a})];")
    for j in range(qb):
        L.append(f"    let b{j} = sb[(buf * 16u + k) * {brow}u + ((tx + {j * txc}u){sw_b})];")
    for q in range(qa):
        for i in range(4):
            for j in range(qb):
                x = f"acc{q}_{i}_{j}"
                L.append(f"    {x} = fma(vec4<f32>(a{q}[{i}]), b{j}, {x});")
    L.append("}")
    L.append("fn multiply(buf: u32, tx: u32, ty: u32) {")
    L += [f"    kstep(buf, {k}u, tx, ty);" for k in range(BK)]
    L.append("}")
    L.append(f"@compute @workgroup_size({threads})")
    L.append("fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {")
    L.append("    tid = t;")
    L.append(f"    n0 = wid.x * {tn}u;")
    L.append(f"    m0 = wid.z * {tm}u;")
    L.append("    tile = wid.y;")
    L.append(f"    let tx = (t % 8u) + 8u * ((t / 32u) % {txc // 8}u);")
    L.append(f"    let ty = ((t / 8u) % 4u) + 4u * ((t / 32u) / {txc // 8}u);")
    L += [f"    {x} = vec4<f32>(0.0);" for x in acc]
    L.append("    let steps = p.k / 16u;")
    L.append("    fetch(0u);")
    L.append("    commit(0u);")
    L.append("    workgroupBarrier();")
    L.append("    var buf = 0u;")
    L.append("    for (var s = 1u; s < steps; s++) {")
    if early:  # the next step's loads in flight during this multiply (ssd_tile's order)
        L.append("        fetch(s * 16u);")
        L.append("        multiply(buf, tx, ty);")
    else:  # after it (linear.wgsl's order: fewer live registers)
        L.append("        multiply(buf, tx, ty);")
        L.append("        fetch(s * 16u);")
    L.append("        commit(buf ^ 1u);")
    L.append("        workgroupBarrier();")
    L.append("        buf ^= 1u;")
    L.append("    }")
    L.append("    multiply(buf, tx, ty);")
    for q in range(qa):
        for i in range(4):
            row = f"ty * 4u + {q * tyc * 4 + i}u"
            for j in range(qb):
                L.append(f"    c[(tile * {m_all}u + m0 + {row}) * {n_all // 4}u + n0 / 4u + tx + {j * txc}u] = acc{q}_{i}_{j};")
    L.append("}")
    return "\n".join(L), threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiles", type=int, default=1536, help="A matrices (Mamba-2 M_STATE: B·chunks·H = 1536)")
    ap.add_argument("--rows", type=int, default=64, help="A's columns M (the SSD's P = 64), a multiple of the tiles' TM")
    ap.add_argument("--cols", type=int, default=128, help="B's columns (the SSD's N = 128), a multiple of TN")
    ap.add_argument("--k", type=int, default=128, help="K, a multiple of 16 (the chunk)")
    ap.add_argument("--configs", default="64x64/4x4,64x64/4x4/late,64x64/8x4/late,64x64/8x8/late,64x128/8x8/late")
    ap.add_argument("--scale", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--per-pass", type=int, default=20, help="dispatches per timed pass on GPUs (CPU adapters: 1)")
    ap.add_argument("--warm-s", type=float, default=0.5, help="seconds of dispatches before each config's timing")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rt = get_runtime(a.device)
    dev = rt.device
    head = header("tile_shapes", rt.info)
    M = a.rows
    print(f"{rt.info.name} ({rt.info.backend}): {a.tiles} tiles of [{a.k}, {M}]ᵀ · [{a.k}, {a.cols}]"
          + (", scaled rows" if a.scale else ""))
    rng = np.random.default_rng(0)
    A = rng.standard_normal((a.tiles, a.k, M), dtype=np.float32)
    B = rng.standard_normal((a.k, a.cols), dtype=np.float32)
    W = -rng.random((a.tiles, a.k), dtype=np.float32)
    Aw = A * np.exp(W)[:, :, None] if a.scale else A
    want = np.einsum("tkm,kn->tmn", Aw.astype(np.float64), B.astype(np.float64))
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    bufs_a = [dev.create_buffer_with_data(data=np.ascontiguousarray(m).tobytes(), usage=usage)
              for m in (A, A.transpose(0, 2, 1))]  # [tiles, K, M] and the K-contiguous [tiles, M, K]
    bufs_b = [dev.create_buffer_with_data(data=np.ascontiguousarray(m).tobytes(), usage=usage) for m in (B, B.T)]
    buf_w = dev.create_buffer_with_data(data=W.tobytes(), usage=usage)
    buf_c = dev.create_buffer(size=a.tiles * M * a.cols * 4, usage=usage)
    uni = dev.create_buffer_with_data(data=np.array([a.k, a.tiles, 0, 0], np.uint32).tobytes(),
                                      usage=wgpu.BufferUsage.UNIFORM)
    flops = 2.0 * a.tiles * M * a.cols * a.k
    queries = resolved = None
    if "timestamp-query" in rt.features:
        queries = dev.create_query_set(type=wgpu.QueryType.timestamp, count=2)
        resolved = dev.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
    for cfg in a.configs.split(","):
        tile, reg, *modes = cfg.split("/")
        tm, tn = (int(v) for v in tile.split("x"))
        rm, rn = (int(v) for v in reg.split("x"))
        src, threads = shader(M, a.cols, tm, tn, rm, rn, a.scale, "late" not in modes, "ka" in modes, "kb" in modes)
        module = _shader_module(dev, f"tile_shapes {cfg}", src, 0)  # no runtime checks, as the runtime compiles
        pipe = dev.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
        entries = [{"binding": 0, "resource": {"buffer": uni, "offset": 0, "size": 16}}]
        buf_a, buf_b = bufs_a["ka" in modes], bufs_b["kb" in modes]
        for i, bb in ((1, buf_a), (2, buf_b), (3, buf_c), (4, buf_w))[:4 if a.scale else 3]:  # w: read only with --scale
            entries.append({"binding": i, "resource": {"buffer": bb, "offset": 0, "size": bb.size}})
        bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=entries)

        def run(n: int) -> float | None:
            """n dispatches in one pass; its GPU time in seconds where the adapter has timestamps."""
            enc = dev.create_command_encoder()
            cp = enc.begin_compute_pass(timestamp_writes={"query_set": queries, "beginning_of_pass_write_index": 0,
                                                          "end_of_pass_write_index": 1} if queries else None)
            cp.set_pipeline(pipe)
            cp.set_bind_group(0, bg)
            for _ in range(n):
                cp.dispatch_workgroups(a.cols // tn, a.tiles, M // tm)
            cp.end()
            if queries:
                enc.resolve_query_set(queries, 0, 2, resolved, 0)
            dev.queue.submit([enc.finish()])
            if not queries:
                dev.queue.read_buffer(buf_c, 0, 16)
                return None
            ticks = np.frombuffer(dev.queue.read_buffer(resolved, 0, 16), np.uint64)
            return (int(ticks[1]) - int(ticks[0])) * 1e-9

        dev.queue.write_buffer(buf_c, 0, np.full(a.tiles * M * a.cols, np.nan, np.float32).tobytes())
        run(1)
        got = np.frombuffer(dev.queue.read_buffer(buf_c), np.float32).reshape(a.tiles, M, a.cols)
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        reps = 1 if is_cpu(rt) else a.per_pass
        keep_busy(rt, lambda: run(reps), a.warm_s)  # noqa: B023
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            gpu = run(reps)
            times.append((gpu if gpu is not None else time.perf_counter() - t0) / reps)
        t = statistics.median(times)
        print(f"{cfg:>12}  {threads:4d} threads  {t * 1e3:8.3f} ms  {flops / t / 1e12:6.2f} TFLOP/s  "
              f"max rel err {err:.1e}" + ("" if err < 1e-5 else "  WRONG"))
        if a.out:
            with open(a.out, "a", encoding="utf-8") as f:
                f.write(json.dumps({**head, "config": cfg, "threads": threads, "tiles": a.tiles, "k": a.k,
                       "scale": a.scale, "ms": t * 1e3, "tflops": flops / t / 1e12, "max_rel_err": err}) + "\n")


if __name__ == "__main__":
    main()
