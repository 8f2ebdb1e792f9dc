"""Benchmark: recurrent decoding (`mambactl generate`'s path) of a random-weight LM on one wgpu adapter, fp32.

    python bench/decode.py --arch attention --d-model 768 --layers 24 --vocab 50280 --batch 1 \
        --prompt-len 512 --new-tokens 128 [--device NVIDIA/Vulkan] [--out results.jsonl]

--arch is one layer type (mamba1 | mamba2 | mamba3 | attention) or a comma list that the layers cycle
through (mamba2,attention: layers 0, 2, ... Mamba-2, layers 1, 3, ... attention). Each repeat draws a random
prompt batch [B, prompt-len], times the parallel prefill (`RecurrentDecoder.prefill`, through reading the
last logits back), then --new-tokens steps, each feeding back the greedy token of the logits it read (the
work per token of `generate`: one step, one logits read). Warm-up repeats (pipeline compilation, first
allocations) are excluded; the median repeat is reported: prefill time, decode tokens/s = batch × steps /
decode time, ms per step, submits per token. Attention layers' KV caches grow during the steps as they would
in `generate` (doubling when full), so that cost is included. Steps replay a captured graph where the decoder
does (models/decode.py; `--no-replay` records every step through the ops). `--gpu-profile` adds the GPU time
of one recorded step by entry point (timestamp queries; the adapter must have them).
Prints a small table and one JSON line (also appended to --out FILE).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from common import add_set_option, apply_sets, header, model_config, pipeline_label, report  # first: it puts the checkout on sys.path
from mambactl.models.config import LAYER_TYPES
from mambactl.models.decode import RecurrentDecoder
from mambactl.models.lm import LanguageModel
from mambactl.models.params import count_parameters, init_parameters
from mambactl.runtime.gpu import get_runtime


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="mamba1",
                   help=f"layer type ({' | '.join(LAYER_TYPES)}) or a comma list the layers cycle through")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--d-state", type=int, default=16)
    p.add_argument("--heads", type=int, default=None, help="attention heads (default d_model / 64)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded in lockstep")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps per repeat")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (prefill + steps)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repeats first")
    p.add_argument("--device", default=None, help="adapter index or name[/backend]; default MAMBACTL_DEVICE or the best")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append the JSON line to this file")
    p.add_argument("--no-replay", action="store_true", help="record every step through the ops (no graph replay)")
    p.add_argument("--gpu-profile", action="store_true", help="GPU time of one step by entry point")
    add_set_option(p)
    a = p.parse_args(argv)
    apply_sets(p, a.set)
    a.arch_list = [s.strip() for s in a.arch.split(",") if s.strip()]
    bad = [s for s in a.arch_list if s not in LAYER_TYPES]
    if bad or not a.arch_list:
        p.error(f"--arch: unknown layer type(s) {', '.join(bad) or '(none)'}; choose from {', '.join(LAYER_TYPES)}")
    if min(a.batch, a.prompt_len, a.new_tokens, a.repeats, a.layers) < 1 or a.warmup < 0:
        p.error("--batch, --prompt-len, --new-tokens, --repeats and --layers must be >= 1, --warmup >= 0")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    rt = get_runtime(a.device)
    info = rt.info
    layers = [a.arch_list[i % len(a.arch_list)] for i in range(a.layers)]
    cfg = model_config(layers, a.d_model, a.vocab, a.d_state, a.heads)
    lm = LanguageModel(cfg, rt, init_parameters(cfg, a.seed))
    rng = np.random.default_rng(a.seed)
    B, L, N, V = a.batch, a.prompt_len, a.new_tokens, a.vocab

    def repeat() -> tuple[float, float, float, int, int]:
        """(prefill s, decode s, submits per token, KV cache bytes and capacity at the end) of one prompt batch."""
        dec = RecurrentDecoder(lm, replay=False if a.no_replay else None)
        rt.sync()
        t0 = time.perf_counter()
        logits = dec.prefill(rng.integers(0, V, (B, L)))
        t1 = time.perf_counter()
        submits0 = rt.submits
        for _ in range(N):
            logits = dec.step(np.argmax(logits[:, :V], axis=1))
        t2 = time.perf_counter()
        caches = [s["cache"] for s in dec.states if "cache" in s]
        return (t1 - t0, t2 - t1, (rt.submits - submits0) / N, sum(2 * c.k.nbytes for c in caches),
                max((c.capacity for c in caches), default=0))

    t_warm = time.perf_counter()
    for _ in range(a.warmup):
        repeat()
    warm_s = time.perf_counter() - t_warm
    runs = [repeat() for _ in range(a.repeats)]
    prefill_s = statistics.median(r[0] for r in runs)
    decode_s = statistics.median(r[1] for r in runs)
    tps = [B * N / r[1] for r in runs]
    submits, cache_bytes, cache_positions = runs[-1][2:]

    result = {
        **header("decode", info),
        "config": {"arch": a.arch, "layers": layers if len(a.arch_list) > 1 else a.layers, "d_model": a.d_model,
                   "vocab": V, "d_state": a.d_state, "attention_heads": cfg.attention.n_heads if "attention" in
                   layers else None, "batch": B, "prompt_len": L, "new_tokens": N, "dtype": "fp32",
                   "params": count_parameters(cfg), "sampling": "greedy on the host"},
        "repeats": a.repeats,
        "warmup": a.warmup,
        "warmup_s": round(warm_s, 3),
        "prefill_ms": round(prefill_s * 1e3, 3),
        "prefill_tokens_per_s": round(B * L / prefill_s, 1),
        "decode_tokens_per_s": round(B * N / decode_s, 1),
        "decode_tokens_per_s_min": round(min(tps), 1),
        "decode_tokens_per_s_max": round(max(tps), 1),
        "step_ms": round(decode_s / N * 1e3, 3),
        "submits_per_token": submits,
        "kv_cache_bytes": cache_bytes,
        "kv_cache_positions": cache_positions,
        "pool_bytes": rt.pool.allocated_bytes,
    }
    rows = [
        ("device", f"{info.name} ({info.backend}, {info.type})"),
        ("config", f"{a.arch} × {a.layers} layers, d_model {a.d_model}, vocab {V}, d_state {a.d_state}, batch {B}, "
                   f"prompt {L}, {N} new tokens, fp32"),
        ("params", f"{result['config']['params']:,}"),
        ("prefill (median)", f"{result['prefill_ms']:.2f} ms  ({result['prefill_tokens_per_s']:,.0f} tokens/s)"),
        ("decode (median)", f"{result['decode_tokens_per_s']:,.1f} tokens/s  ({result['step_ms']:.2f} ms/step; min "
                            f"{result['decode_tokens_per_s_min']:,.1f}, max {result['decode_tokens_per_s_max']:,.1f}; "
                            f"{a.repeats} timed, {a.warmup} warm-up in {warm_s:.1f} s)"),
        ("submits/token", f"{submits:g}"),
    ]
    if cache_bytes:
        rows.append(("KV cache", f"{cache_bytes / 2**20:.2f} MiB, room for {cache_positions} positions "
                                 f"({L + N} used)"))
    if a.gpu_profile:
        result["gpu_profile"] = gpu_profile(rt, lm, rng, a)
        ms = sum(v[0] for v in result["gpu_profile"].values())
        calls = sum(v[1] for v in result["gpu_profile"].values())
        top = sorted(result["gpu_profile"].items(), key=lambda kv: -kv[1][0])[:8]
        rows.append(("GPU per step", f"{ms:.3f} ms in {calls} dispatches; " + ", ".join(f"{k} {v[0]:.3f} ({v[1]})"
                                                                                  for k, v in top)))
    report(rows, result, a.out)
    return 0


def gpu_profile(rt, lm, rng, a) -> dict:
    """{entry point label: [GPU ms, dispatches]} of one decoding step recorded through the ops."""
    if "timestamp-query" not in rt.features:
        raise SystemExit(f"--gpu-profile: {rt.info.name} has no timestamp-query feature")
    dec = RecurrentDecoder(lm, replay=False)
    logits = dec.prefill(rng.integers(0, a.vocab, (a.batch, a.prompt_len)))
    logits = dec.step(np.argmax(logits[:, :a.vocab], axis=1))  # pipelines compiled outside the profiled step
    rt.gpu_times = []
    dec.step(np.argmax(logits[:, :a.vocab], axis=1))
    entries: dict = {}
    for entry, constants, ns in rt.gpu_times:
        e = entries.setdefault(pipeline_label(entry, constants), [0.0, 0])
        e[0] += ns * 1e-6
        e[1] += 1
    rt.gpu_times = None
    return {k: [round(v[0], 4), v[1]] for k, v in entries.items()}


if __name__ == "__main__":
    sys.exit(main())
