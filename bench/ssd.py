"""One SSD layer's forward and backward alone: per-dispatch GPU time, FLOPs and bytes per kernel, one JSON line.

    python bench/ssd.py [--batch 8 --seq 1024 --heads 24 --headdim 64 --groups 1 --d-state 128 --chunk 256]
        [--op mamba2|core|siso] [--repeats 5] [--set NAME=VALUE ...] [--device D] [--out FILE]

`--op mamba2` times `ssd_scan` + `ssd_scan_backward` (Mamba-2: Δ from dt_raw inside), `--op core` the core
`ssd_chunked` + `ssd_chunked_backward` (adt, scale given; D on), `--op siso` the core as Mamba-3 SISO runs it
(a diagonal weight, no D). The defaults are the mamba2-130m layer; the Mamba-3 SISO shape:
`--op siso --groups 24 --chunk 64`. Wall time: median of `--repeats`
synced calls (forward alone, forward + backward). Then one call with GPU timestamps per dispatch (the adapter's
`timestamp-query`; each dispatch then runs in its own pass) gives the per-entry table with the FLOPs and bytes
`mambactl.ops.ssd.kernel_costs` predicts for it and the rates they imply. `--set` overrides one of
mambactl.ops.ssd's integer tuning constants for this run (e.g. DCB_WORKGROUPS=2048), to compare settings.
`--variants "chunk=128;chunk=64,DCB_WORKGROUPS=2048;..."` instead compares settings in one process: each variant
(the chunk and / or such constants) is timed by GPU timestamps once per round, round robin for `--repeats`
rounds, and the table gives each variant's GPU ms per round and its per-entry ms in the last.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from common import header, keep_busy, pipeline_label, report  # first: it puts the checkout on sys.path

import numpy as np  # noqa: E402

from mambactl.ops import ssd  # noqa: E402
from mambactl.runtime.gpu import get_runtime  # noqa: E402


def label(entry: str, constants: dict | None) -> str:
    """The entry as kernel_costs keys it: VEC4 and F_SKEW left out (a load width, a layout in workgroup memory)."""
    return pipeline_label(entry, constants, leave_out=("VEC4", "F_SKEW"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("batch", 8), ("seq", 1024), ("heads", 24), ("headdim", 64), ("groups", 1),
                          ("d-state", 128), ("chunk", 256), ("repeats", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--op", default="mamba2", choices=["mamba2", "core", "siso"])
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--variants", default=None, help="';'-separated variants, each 'NAME=VALUE,...' (chunk or "
                   "mambactl.ops.ssd integer constants), compared round robin in this process")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    tuned = {}
    for item in a.set:
        name, value = item.split("=")
        if not isinstance(getattr(ssd, name, None), int):
            p.error(f"--set {item}: mambactl.ops.ssd has no integer constant {name}")
        setattr(ssd, name, int(value))
        tuned[name] = int(value)
    rt = get_runtime(a.device)
    B, L, H, P, G, N = a.batch, a.seq, a.heads, a.headdim, a.groups, a.d_state
    rng = np.random.default_rng(0)

    def t(*shape, scale=1.0, shift=0.0):
        return rt.from_numpy((scale * rng.standard_normal(shape) + shift).astype(np.float32))

    x, Bm, Cm, dy, D = t(B, L, H, P), t(B, L, G, N), t(B, L, G, N), t(B, L, H, P), t(H)
    if a.op == "mamba2":
        dt_raw, A_log, dt_bias = t(B, L, H, scale=0.5, shift=-2.0), t(H, scale=0.5, shift=1.0), t(H, scale=0.3)
        grads = {"A_log": t(H), "D": t(H), "dt_bias": t(H)}

        def forward():
            return ssd.ssd_scan(x, dt_raw, A_log, Bm, Cm, D, dt_bias, chunk=a.chunk)  # noqa: B023

        def backward(saved):
            return ssd.ssd_scan_backward(saved, dy, grads)
    else:
        adt = rt.from_numpy(-np.abs(0.1 * rng.standard_normal((B, L, H))).astype(np.float32))
        scale = t(B, L, H, scale=0.1, shift=0.1)
        siso = a.op == "siso"
        diag = t(B, L, H, scale=0.05, shift=0.05) if siso else None
        grads = None if siso else {"D": t(H)}

        def forward():
            return ssd.ssd_chunked(x, adt, scale, Bm, Cm, None if siso else D, chunk=a.chunk, diag=diag)  # noqa: B023

        def backward(saved):
            return ssd.ssd_chunked_backward(saved, dy, grads)

    def timed(fn) -> float:
        rt.sync()
        t0 = time.perf_counter()
        fn()
        rt.sync()
        return time.perf_counter() - t0

    def both():
        _, saved = forward()
        backward(saved)

    if a.variants:
        compare(rt, a, both)
        return
    timed(both)  # compile pipelines, fill the pool
    fwd = statistics.median(timed(forward) for _ in range(a.repeats))
    total = statistics.median(timed(both) for _ in range(a.repeats))

    times: dict = collections.defaultdict(float)
    counts: dict = collections.Counter()
    gpu_clock = "timestamp-query" in rt.features
    if gpu_clock:
        keep_busy(rt, both)
        rt.gpu_times = []
        both()
        rt.sync()
        for entry, constants, ns in rt.gpu_times:
            key = label(entry, constants)
            times[key] += ns * 1e-9
            counts[key] += 1
        rt.gpu_times = None
    chunk = min(a.chunk, L)
    costs = ssd.kernel_costs(B, L, H, P, G, N, chunk, ssd.tile_engine(rt, ssd.kernel_loops(chunk, P, N, H, G)))
    rows = [("device", f"{rt.info.name} ({rt.info.backend})"),
            ("shape", f"B {B}, L {L}, H {H}, P {P}, G {G}, N {N}, chunk {chunk}, op {a.op} {tuned or ''}"),
            ("forward", f"{fwd * 1e3:.3f} ms (median of {a.repeats}, synced)"),
            ("forward + backward", f"{total * 1e3:.3f} ms")]
    entries = {}
    if times:
        rows.append(("GPU time in dispatches", f"{sum(times.values()) * 1e3:.3f} ms (timestamps)"))
        for key, sec in sorted(times.items(), key=lambda kv: -kv[1]):
            flops, nbytes = costs.get(key, costs.get(key.split("[")[0], (0, 0)))
            flops, nbytes = flops * counts[key], nbytes * counts[key]  # kernel_costs counts one call
            rate = f"  {flops / sec * 1e-12:6.2f} TFLOP/s" if flops else ""
            bw = f"  {nbytes / sec * 1e-9:7.1f} GB/s" if nbytes else ""
            rows.append((f"  {key}", f"{sec * 1e3:8.3f} ms  {counts[key]:3d} calls{rate}{bw}"))
            entries[key] = {"ms": round(sec * 1e3, 4), "calls": counts[key], "flops": flops, "bytes": nbytes}
    result = header("ssd", rt.info) | {
        "config": {"op": a.op, "batch": B, "seq": L, "heads": H, "headdim": P, "groups": G, "d_state": N,
                   "chunk": chunk, "set": tuned},
        "forward_ms": round(fwd * 1e3, 4), "forward_backward_ms": round(total * 1e3, 4),
        "clock": "GPU timestamps" if gpu_clock else None, "entries": entries}
    report(rows, result, a.out)


def compare(rt, a, both) -> None:
    """--variants: each variant's GPU time (timestamps) per round, round robin; per-entry ms of the last round."""
    variants = [dict(kv.split("=") for kv in v.split(",")) for v in a.variants.split(";")]
    defaults = {k: (a.chunk if k == "chunk" else getattr(ssd, k)) for v in variants for k in v}

    def apply(v):
        for k, default in defaults.items():
            value = int(v.get(k, default))
            if k == "chunk":
                a.chunk = value
            else:
                setattr(ssd, k, value)

    for v in variants:  # compile every variant's pipelines first
        apply(v)
        both()
    rt.sync()
    totals = [[] for _ in variants]
    last: list = [None] * len(variants)
    for _ in range(a.repeats):
        for i, v in enumerate(variants):
            apply(v)
            keep_busy(rt, both)
            rt.gpu_times = []
            both()
            rt.sync()
            per: dict = collections.defaultdict(float)
            for entry, constants, ns in rt.gpu_times:
                per[label(entry, constants)] += ns * 1e-6
            rt.gpu_times = None
            totals[i].append(sum(per.values()))
            last[i] = per
    print(f"{rt.info.name}; B {a.batch}, L {a.seq}, H {a.heads}, P {a.headdim}, G {a.groups}, N {a.d_state}, "
          f"op {a.op}: GPU ms of forward + backward per round (timestamps), round robin")
    for v, ms, per in zip(variants, totals, last):
        name = ",".join(f"{k}={val}" for k, val in v.items())
        print(f"{name:40s} " + " ".join(f"{t:7.3f}" for t in ms) + f"   min {min(ms):.3f}")
        print("    " + "  ".join(f"{k} {t:.3f}" for k, t in sorted(per.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
