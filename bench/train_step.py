"""Benchmark: LM training steps of one layer type (--arch) on one wgpu adapter (fwd, bwd, AdamW + clip, fp32).

    python bench/train_step.py --d-model 768 --layers 24 --vocab 50280 --seq 1024 --batch 8 --steps 5 \
        [--device NVIDIA/Vulkan] [--peer hf-mambapy] [--out results.jsonl]

Each step: zero the gradients, forward with the loss, backward, `adamw_step` (clip 1.0, weight decay 0.1 on
the decayed set), on a fresh random token batch; then `rt.sync()` (flush + wait for the GPU). The clock runs
from just before the step to just after its sync, so a step's time is everything it costs the host and the
GPU; warm-up steps (pipeline compilation, first allocations) are excluded and the median step is reported.
Then the same number of steps run streamed, as `mambactl train` runs them between two log points (and as the
peer script times its steps): each step flushed to the GPU, one sync after the last, so the host records step
n + 1 while the GPU runs step n; the streamed step time is that total over the steps. (Mesa lavapipe runs a
submitted command buffer before vkQueueSubmit returns — the submitting thread waits for it — so on that adapter
nothing overlaps and streamed is synced without the per-step readback; the streamed time is a mean, so compare it
with the synced mean, also reported, not the median.)

With --peer IMPL (hf | hf-mambapy | mambapy | ssm) and torch importable, the PyTorch peer of
../shared/bench/peer_torch.py runs the same shape in a subprocess *before* our measurement (so the two never
share the GPU), on cuda when our adapter is a GPU and torch sees one, else on the CPU (--peer-device to force).
Prints a small table and one JSON line (also appended to --out FILE).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, add_set_option, apply_sets, header, model_config, report, training_step  # first: it puts the checkout on sys.path
from mambactl.models.params import count_parameters
from mambactl.runtime.gpu import get_runtime


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--d-state", type=int, default=16)
    p.add_argument("--arch", default="mamba1", choices=["mamba1", "mamba2", "mamba3"], help="layer type of every layer")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--device", default=None, help="adapter index or name[/backend]; default MAMBACTL_DEVICE or the best")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--matmul-precision", default="fp32", choices=["fp32", "f16"],
                   help="the GEMMs' precision ([train] matmul_precision); master weights and AdamW stay fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append the JSON line to this file")
    p.add_argument("--peer", default=None, help="also time peer_torch.py --impl PEER on the same shape")
    p.add_argument("--peer-script", default=str(REPO.parent / "shared" / "bench" / "peer_torch.py"))
    p.add_argument("--peer-device", default="auto", help="cuda | cpu | auto (cuda when our adapter is a GPU and torch sees one)")
    p.add_argument("--peer-steps", type=int, default=None, help="peer timed steps (default: --steps)")
    p.add_argument("--peer-warmup", type=int, default=None, help="peer warm-up steps (default: --warmup)")
    p.add_argument("--peer-tf32", action="store_true", help="let the peer use TF32 matmuls (ours is plain fp32)")
    p.add_argument("--peer-timeout", type=float, default=900.0)
    p.add_argument("--progress", action="store_true", help="print each step's time to stderr as it ends")
    add_set_option(p)
    a = p.parse_args(argv)
    apply_sets(p, a.set)
    return a


def run_peer(a, gpu_adapter: bool) -> dict:
    """Time the PyTorch peer in a subprocess; returns its fields, or {"error": ...}."""
    if a.peer in ("hf-mambapy", "mambapy") and importlib.util.find_spec("mambapy") is None:
        # Without it transformers silently runs its sequential per-step loop (H200, Mamba-1 130m: 204 tokens/s against 9.4k).
        return {"impl": a.peer, "error": "mambapy is not importable (pip install mambapy), so there is no such peer here"}
    if importlib.util.find_spec("torch") is None:
        return {"impl": a.peer, "error": "torch is not importable"}
    script = Path(a.peer_script)
    if not script.is_file():
        return {"impl": a.peer, "error": f"no peer script at {script}"}
    device = a.peer_device
    if device == "auto":
        device = "cpu"
        if gpu_adapter:
            probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                                   capture_output=True, text=True)
            device = "cuda" if probe.stdout.strip() == "True" else "cpu"
    cmd = [sys.executable, str(script), "--impl", a.peer, "--arch", a.arch, "--d-model", str(a.d_model),
           "--layers", str(a.layers), "--vocab", str(a.vocab), "--d-state", str(a.d_state), "--seq", str(a.seq),
           "--batch", str(a.batch), "--steps", str(a.peer_steps or a.steps),
           "--warmup", str(a.peer_warmup if a.peer_warmup is not None else a.warmup), "--device", device]
    if a.peer_tf32:
        cmd.append("--tf32")
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.peer_timeout)
    except subprocess.TimeoutExpired:
        return {"impl": a.peer, "device": device, "error": f"timed out after {a.peer_timeout:.0f} s"}
    line = next((x for x in r.stdout.splitlines() if x.startswith("PEER ")), None)
    if r.returncode != 0 or line is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"impl": a.peer, "device": device, "error": f"exit {r.returncode}: {tail[0][:300]}"}
    fields = dict(re.findall(r"(\S+)=(\S+)", line))
    out = {"impl": a.peer, "device": device, "tf32": a.peer_tf32, "line": line,
           "wall_s": round(time.perf_counter() - t0, 1)}
    if device == "cuda":
        name = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                              capture_output=True, text=True).stdout.strip()
        out["device_name"] = name
    for k, conv in (("tokens_per_s", float), ("step_s", float), ("params", int), ("loss", float)):
        if k in fields:
            out[k] = conv(fields[k])
    out["timing"] = "mean of timed steps (peer_torch.py), one fixed batch"
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    rt = get_runtime(a.device)
    rt.matmul_precision = a.matmul_precision
    info = rt.info
    gpu_adapter = info.type != "CPU"

    peer = run_peer(a, gpu_adapter) if a.peer else None
    if a.progress and peer is not None:
        print(f"peer: {peer.get('line') or peer.get('error')}", file=sys.stderr, flush=True)

    cfg = model_config([a.arch] * a.layers, a.d_model, a.vocab, a.d_state)
    step, opt = training_step(rt, cfg, a.batch, a.seq, seed=a.seed, lr=a.lr)
    B, L, V = a.batch, a.seq, a.vocab

    rt.sync()
    t_warm = time.perf_counter()
    loss = None
    for i in range(a.warmup):
        loss = step()
        rt.sync()
        if a.progress:
            print(f"warm-up step {i}: {time.perf_counter() - t_warm:.3f} s since start", file=sys.stderr, flush=True)
    warm_s = time.perf_counter() - t_warm
    first_loss = float(loss.numpy()[0]) if loss is not None else None

    times, submits0 = [], rt.submits
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = step()
        rt.sync()
        times.append(time.perf_counter() - t0)
        if a.progress:
            print(f"step {len(times)}: {times[-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    submits = (rt.submits - submits0) / max(1, a.steps)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
        rt.flush()
    rt.sync()
    streamed = (time.perf_counter() - t0) / max(1, a.steps)
    last_loss = float(loss.numpy()[0]) if loss is not None else None
    counters = opt.read_counters()

    med = statistics.median(times) if times else float("nan")
    tokens = B * L
    result = {
        **header("train_step", info),
        "config": {"arch": a.arch, "d_model": a.d_model, "layers": a.layers, "vocab": a.vocab, "seq": L, "batch": B,
                   "d_state": a.d_state, "dtype": "fp32", "matmul_precision": a.matmul_precision, "params": count_parameters(cfg),
                   "optimizer": "adamw clip=1.0 wd=0.1", **({"set": a.set} if a.set else {})},
        "steps": a.steps,
        "warmup": a.warmup,
        "warmup_s": round(warm_s, 3),
        "step_ms": round(med * 1e3, 3),
        "step_ms_min": round(min(times) * 1e3, 3) if times else None,
        "step_ms_max": round(max(times) * 1e3, 3) if times else None,
        # The streamed figure is a mean (total / steps); on a loaded CPU machine a step's times are heavy-tailed, so
        # compare it with this, not with the median.
        "step_ms_mean": round(statistics.fmean(times) * 1e3, 3) if times else None,
        "tokens_per_s": round(tokens / med, 1) if times else None,
        "streamed_step_ms": round(streamed * 1e3, 3) if a.steps else None,
        "streamed_tokens_per_s": round(tokens / streamed, 1) if a.steps else None,
        "submits_per_step": submits,
        "loss_first": first_loss,
        "loss_last": last_loss,
        "optimizer_steps": counters["step"],
        "skipped_steps": counters["skipped_steps"],
        "pool_bytes": rt.pool.allocated_bytes,
    }
    if peer is not None:
        result["peer"] = peer
        if result["tokens_per_s"] and peer.get("tokens_per_s"):
            result["ratio_vs_peer"] = round(result["tokens_per_s"] / peer["tokens_per_s"], 4)
            result["streamed_ratio_vs_peer"] = round(result["streamed_tokens_per_s"] / peer["tokens_per_s"], 4)

    rows = [
        ("device", f"{info.name} ({info.backend}, {info.type})"),
        ("config", f"d_model {a.d_model}, {a.layers} layers, vocab {V}, L {L}, batch {B}, d_state {a.d_state}, fp32 "
                   f"(GEMMs {a.matmul_precision})"),
        ("params", f"{result['config']['params']:,}"),
        ("step (median)", f"{result['step_ms']:.2f} ms  (min {result['step_ms_min']}, max {result['step_ms_max']}, "
                          f"mean {result['step_ms_mean']}, {a.steps} timed, {a.warmup} warm-up in {warm_s:.1f} s)"),
        ("tokens/s", f"{result['tokens_per_s']:,.0f}"),
        ("streamed", f"{result['streamed_step_ms']:.2f} ms per step, {result['streamed_tokens_per_s']:,.0f} tokens/s "
                     f"({a.steps} steps, one sync)" if a.steps else "-"),
        ("submits/step", f"{submits:g}"),
        ("loss", f"{first_loss} -> {last_loss}"),
    ]
    if peer is not None:
        if "tokens_per_s" in peer:
            rows.append((f"peer {peer['impl']} ({peer['device']})", f"{peer['tokens_per_s']:,.0f} tokens/s"))
            rows.append(("ratio ours/peer", f"{result.get('ratio_vs_peer', float('nan')):.3f} synced, "
                                            f"{result.get('streamed_ratio_vs_peer', float('nan')):.3f} streamed"))
        else:
            rows.append((f"peer {peer['impl']}", peer["error"]))
    report(rows, result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
