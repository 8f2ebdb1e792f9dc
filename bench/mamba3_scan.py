"""One Mamba-3 scan layer alone: `ops.mamba3_scan` forward and `mamba3_scan_backward` on random inputs in the
block's ranges, per entry point by GPU timestamps (`Runtime.gpu_times`), for one or several chunk lengths.

    python bench/mamba3_scan.py --batch 8 --seq 1024 --heads 24 --headdim 64 --d-state 128 --rank 1 \
        --chunk 64,128,256 [--repeats 3] [--device D] [--out FILE]

Each chunk: one untimed forward + backward (pipeline compilation, the pool), then --repeats timed ones with a
timestamp pair per dispatch; the table gives ms per call of each entry point and the forward / backward sums,
and the wall-clock ms of an untimed, synced forward + backward. Without `timestamp-query` only the wall clock.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

from common import header  # first: it puts the checkout on sys.path

import numpy as np  # noqa: E402

from mambactl.ops.mamba3_scan import mamba3_scan, mamba3_scan_backward  # noqa: E402
from mambactl.runtime.gpu import get_runtime  # noqa: E402


def inputs(rt, b, l, h, r, n, p, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s, scale=1.0: rt.from_numpy((scale * rng.standard_normal(s)).astype(np.float32))  # noqa: E731
    dt = (0.01 + 0.1 * rng.random((b, l, h))).astype(np.float32)
    adt = (-(0.5 + rng.random((b, l, h))) * dt).astype(np.float32)
    lam = rng.random((b, l, h)).astype(np.float32)
    return [f(b, l, h, r, n, scale=0.3), f(b, l, h, r, n, scale=0.3), f(b, l, h, r, p), rt.from_numpy(adt),
            rt.from_numpy(dt), rt.from_numpy(lam)], f(b, l, h, r, p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("batch", 8), ("seq", 1024), ("heads", 24), ("headdim", 64), ("d-state", 128),
                          ("rank", 1), ("repeats", 3)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--chunk", default="64", help="comma-separated chunk lengths")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rt = get_runtime(a.device)
    args, dy = inputs(rt, a.batch, a.seq, a.heads, a.rank, a.d_state, a.headdim)
    timed = "timestamp-query" in rt.features
    results = []
    for chunk in (int(c) for c in a.chunk.split(",")):
        def run():
            y, saved = mamba3_scan(*args, chunk=chunk)
            rt.flush()  # the timestamps of what is submitted: the forward's are those before this
            n_fwd = len(rt.gpu_times) if rt.gpu_times is not None else 0
            grads = mamba3_scan_backward(saved, dy)
            return y, grads, n_fwd

        run()
        rt.sync()
        t0 = time.perf_counter()
        run()
        rt.sync()
        wall = (time.perf_counter() - t0) * 1e3
        per_entry: dict = collections.defaultdict(float)
        phase = {"forward": 0.0, "backward": 0.0}
        if timed:
            for _ in range(a.repeats):
                rt.gpu_times = []
                _, _, n_fwd = run()
                rt.sync()
                for i, (entry, consts, ns) in enumerate(rt.gpu_times):
                    key = entry + ("" if not consts else "[" + ",".join(k for k, v in sorted(consts.items()) if v)
                                   + "]")
                    per_entry[key] += ns * 1e-6 / a.repeats
                    phase["forward" if i < n_fwd else "backward"] += ns * 1e-6 / a.repeats
            rt.gpu_times = None
        print(f"chunk {chunk}: wall fwd+bwd {wall:.2f} ms; GPU forward {phase['forward']:.3f} ms, backward "
              f"{phase['backward']:.3f} ms")
        for k, v in sorted(per_entry.items(), key=lambda kv: -kv[1]):
            print(f"  {k:52s} {v:8.3f} ms")
        results.append({"chunk": chunk, "wall_ms": round(wall, 3), "forward_ms": round(phase["forward"], 3),
                        "backward_ms": round(phase["backward"], 3),
                        "entries": {k: round(v, 4) for k, v in per_entry.items()}})
    record = header("mamba3_scan", rt.info) | {"shape": {
        "batch": a.batch, "seq": a.seq, "heads": a.heads, "headdim": a.headdim, "d_state": a.d_state,
        "rank": a.rank}, "clock": "GPU timestamps" if timed else "wall clock", "results": results}
    line = json.dumps(record)
    print(line)
    if a.out:
        with open(a.out, "a", encoding="utf-8") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
