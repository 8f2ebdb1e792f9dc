"""The Mamba-1 selective scan alone: GPU time per call of each dispatch of the forward and the backward.

    python bench/scan.py [--batch 8] [--seq 1024] [--channels 1536] [--d-state 16] [--chunk C] [--repeats 5]
        [--path tiled|direct|subgroup] [--variant chunk=C]... [--device D]

Each repeat records one forward and one backward (with the parameter gradients accumulated, as in training) and
times every dispatch with GPU timestamps (`Runtime.gpu_times`, needs `timestamp-query`); the table gives each
entry point's median over the repeats, and one JSON line follows. Copied into another checkout (the measured
tree first on sys.path, as bench/common.py arranges), it times that checkout's kernels. Each `--variant` (a
chunk) is timed after the defaults in the same process (round robin over the repeats), one table and one JSON
line each; each timed call follows --warm-seconds of untimed ones.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

from common import commit  # first: it puts the checkout on sys.path

import numpy as np  # noqa: E402

from mambactl.ops import selective_scan as scan  # noqa: E402
from mambactl.runtime.gpu import get_runtime  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--channels", type=int, default=1536)
    p.add_argument("--d-state", type=int, default=16)
    p.add_argument("--chunk", type=int, default=None, help="steps between saved states (default: the wrapper's)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--path", default=None, choices=list(scan.PATHS))
    p.add_argument("--variant", action="append", default=[],
                   help="chunk=C: a chunk to time after the defaults")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop starting repeats (rounds) after this much wall time; report what was timed")
    p.add_argument("--warm-seconds", type=float, default=0.5,
                   help="untimed calls queued right before each timed one, about this long (GPU clocks drop when "
                        "it idles between short synced rounds)")
    p.add_argument("--device", default=None)
    a = p.parse_args()
    variants = [{}] + [{k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))} for spec in a.variant]
    rt = get_runtime(a.device)
    rng = np.random.default_rng(0)
    B, L, Dc, N = a.batch, a.seq, a.channels, a.d_state

    def normal(*shape, scale=1.0):
        return rt.from_numpy((scale * rng.standard_normal(shape)).astype(np.float32))

    x = dict(u=normal(B, L, Dc), delta=normal(B, L, Dc, scale=0.5),
             A_log=rt.from_numpy(np.tile(np.log(np.arange(1, N + 1, dtype=np.float32)), (Dc, 1))),
             B=normal(B, L, N), C=normal(B, L, N), D=normal(Dc), z=normal(B, L, Dc), delta_bias=normal(Dc, scale=0.2))
    dy = normal(B, L, Dc)
    grads = {"A_log": normal(Dc, N), "D": normal(Dc), "delta_bias": normal(Dc)}

    chunk = a.chunk

    def once():
        y, saved = scan.selective_scan(x["u"], x["delta"], x["A_log"], x["B"], x["C"], x["D"], x["z"],
                                       x["delta_bias"], chunk=chunk, path=a.path)
        return y, scan.selective_scan_backward(saved, dy, grads, path=a.path)

    def select(variant):
        nonlocal chunk
        unknown = set(variant) - {"chunk"}
        if unknown:
            raise SystemExit(f"unknown variant keys {sorted(unknown)} (only chunk)")
        chunk = variant.get("chunk", a.chunk)

    start = time.perf_counter()
    usable = []
    call_s = {}
    for variant in variants:
        select(variant)
        try:
            once()  # compile the pipelines, fill the pool
            rt.sync()
            t0 = time.perf_counter()
            once()
            rt.sync()
            call_s[len(usable)] = time.perf_counter() - t0
            usable.append(variant)
        except Exception as e:  # noqa: BLE001 - a variant the device refuses is reported, the others still run
            print(f"variant {variant}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    # Round robin: each repeat times every variant once, so load from other work on a shared device spreads
    # over all of them instead of landing on the last ones.
    samples = [collections.defaultdict(list) for _ in usable]
    for rnd in range(a.repeats):
        if a.max_seconds is not None and rnd > 0 and time.perf_counter() - start > a.max_seconds:
            print(f"stopped after {rnd} repeats ({a.max_seconds} s)")
            break
        for i, (variant, got) in enumerate(zip(usable, samples)):
            select(variant)
            for _ in range(int(a.warm_seconds / max(call_s[i], 1e-4))):
                once()
            rt.flush()
            rt.gpu_times = []
            once()
            rt.sync()
            per: dict = collections.defaultdict(float)
            for entry, constants, ns in rt.gpu_times:
                per[entry] += ns * 1e-6
            rt.gpu_times = None
            for k, v in per.items():
                got[k].append(v)
    for variant, got in zip(usable, samples):
        select(variant)
        med = {k: float(np.median(v)) for k, v in got.items()}
        fwd = sum(v for k, v in med.items() if "forward" in k)
        total = sum(med.values())
        print(f"{rt.info.name}: B {B}, L {L}, Dc {Dc}, N {N}, chunk {chunk}, path {a.path or 'auto'}, "
              f"variant {variant or 'defaults'}")
        for k, v in sorted(med.items(), key=lambda kv: -kv[1]):
            print(f"  {k:40s} {v:8.3f} ms")
        print(f"  forward {fwd:.3f} ms, backward {total - fwd:.3f} ms, total {total:.3f} ms per layer")
        print(json.dumps({"bench": "scan", "commit": commit(), "device": rt.info.name, "B": B, "L": L, "Dc": Dc,
                          "N": N, "chunk": chunk, "path": a.path or "auto", "variant": variant,
                          "repeats": a.repeats, "ms": {k: round(v, 4) for k, v in med.items()},
                          "forward_ms": round(fwd, 4), "backward_ms": round(total - fwd, 4)}))


if __name__ == "__main__":
    main()
