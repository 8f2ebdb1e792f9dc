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
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from common import header, report  # first: it puts the checkout on sys.path

import numpy as np  # noqa: E402

from mambactl.ops import ssd  # noqa: E402
from mambactl.runtime.gpu import get_runtime  # noqa: E402


def label(entry: str, constants: dict | None) -> str:
    """entry[NAME,...,KEY=value] as kernel_costs keys it: true flags by name, numbers as KEY=value, VEC4 left out
    (it only picks the load width)."""
    parts = [k if v is True else f"{k}={v}" for k, v in sorted((constants or {}).items())
             if k != "VEC4" and v is not False]
    return entry + (f"[{','.join(parts)}]" if parts else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("batch", 8), ("seq", 1024), ("heads", 24), ("headdim", 64), ("groups", 1),
                          ("d-state", 128), ("chunk", 256), ("repeats", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--op", default="mamba2", choices=["mamba2", "core", "siso"])
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
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
            return ssd.ssd_scan(x, dt_raw, A_log, Bm, Cm, D, dt_bias, chunk=a.chunk)

        def backward(saved):
            return ssd.ssd_scan_backward(saved, dy, grads)
    else:
        adt = rt.from_numpy(-np.abs(0.1 * rng.standard_normal((B, L, H))).astype(np.float32))
        scale = t(B, L, H, scale=0.1, shift=0.1)
        siso = a.op == "siso"
        diag = t(B, L, H, scale=0.05, shift=0.05) if siso else None
        grads = None if siso else {"D": t(H)}

        def forward():
            return ssd.ssd_chunked(x, adt, scale, Bm, Cm, None if siso else D, chunk=a.chunk, diag=diag)

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

    timed(both)  # compile pipelines, fill the pool
    fwd = statistics.median(timed(forward) for _ in range(a.repeats))
    total = statistics.median(timed(both) for _ in range(a.repeats))

    times: dict = collections.defaultdict(float)
    counts: dict = collections.Counter()
    gpu_clock = "timestamp-query" in rt.features
    if gpu_clock:
        rt.gpu_times = []
        both()
        rt.sync()
        for entry, constants, ns in rt.gpu_times:
            key = label(entry, constants)
            times[key] += ns * 1e-9
            counts[key] += 1
        rt.gpu_times = None
    chunk = min(a.chunk, L)
    costs = ssd.kernel_costs(B, L, H, P, G, N, chunk)
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


if __name__ == "__main__":
    main()
