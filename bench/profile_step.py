"""Where a training step's GPU time goes: per-entry-point time of one LM training step.

    python bench/profile_step.py --arch mamba1|mamba2|mamba3 --d-model 768 --layers 24 --vocab 50280 --seq 1024
        --batch 8 --d-state 16 [--device D]

With the adapter's `timestamp-query` feature every dispatch runs in its own compute pass with GPU timestamps
(`Runtime.gpu_times`): the table lists each WGSL entry point's total GPU time, dispatch count and share, and
the gap between their sum and the unprofiled step is launch, barrier and host time. `--set ssd.FORCE_CHUNK=128`
(any integer constant of a mambactl.ops module) profiles a setting. Without the feature each
dispatch is submitted and waited for on its own and timed by the wall clock (then each call also carries a
submit and a readback, ~0.3 ms on an H200).
"""

from __future__ import annotations

import argparse
import collections
import json
import time

from common import add_set_option, apply_sets, model_config, training_step  # first: it puts the checkout on sys.path


from mambactl.runtime.gpu import get_runtime  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("d-model", 64), ("layers", 2), ("vocab", 512), ("seq", 64), ("batch", 8), ("d-state", 16)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--arch", default="mamba1", choices=["mamba1", "mamba2", "mamba3"], help="layer type of every layer")
    p.add_argument("--device", default=None)
    add_set_option(p)
    a = p.parse_args()
    apply_sets(p, a.set)
    rt = get_runtime(a.device)
    cfg = model_config([a.arch] * a.layers, a.d_model, a.vocab, a.d_state)
    one_step, _ = training_step(rt, cfg, a.batch, a.seq)

    def step():
        one_step()
        rt.sync()

    step()  # compile pipelines, fill the pool
    t = time.perf_counter()
    step()
    plain = time.perf_counter() - t

    times: dict = collections.defaultdict(float)
    counts: dict = collections.Counter()

    def add(entry, constants, seconds):
        key = entry + ("" if not constants else "[" + ",".join(k for k, v in sorted(constants.items()) if v) + "]")
        times[key] += seconds
        counts[key] += 1

    gpu_clock = "timestamp-query" in rt.features
    if gpu_clock:
        rt.gpu_times = []
        step()
        for entry, constants, ns in rt.gpu_times:
            add(entry, constants, ns * 1e-9)
        rt.gpu_times = None
    else:
        run = rt.run

        def timed(entry, groups, constants=None, **kw):
            rt.sync()
            t0 = time.perf_counter()
            run(entry, groups, constants, **kw)
            rt.sync()
            add(entry, constants, time.perf_counter() - t0)

        rt.run = timed
        step()
    total = sum(times.values())
    clock = "GPU timestamps" if gpu_clock else "wall clock, each dispatch synced"
    print(f"{rt.info.name} ({rt.info.backend}); step {plain * 1e3:.1f} ms unprofiled; {total * 1e3:.1f} ms in "
          f"dispatches ({clock})")
    print(f"{'entry point':48s} {'ms':>9s} {'calls':>6s} {'share':>6s}")
    for k, v in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"{k:48s} {v * 1e3:9.2f} {counts[k]:6d} {v / total:6.1%}")
    print(json.dumps({"device": rt.info.name, "arch": a.arch, "clock": clock, "step_ms": plain * 1e3,
                      "entries": {k: [round(v * 1e3, 3), counts[k]] for k, v in times.items()}}))


if __name__ == "__main__":
    main()
