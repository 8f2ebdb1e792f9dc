"""Peer for bench/decode.py: greedy decoding tokens/s of HF transformers' Mamba / Mamba-2 in PyTorch, same shape.

    python bench/peer_decode.py --arch mamba1|mamba2 --d-model 768 --layers 24 --vocab 50280 --d-state 16
        --prompt-len 512 --new-tokens 128 [--device cuda] [--repeats 3]

Random weights (seed 0), batch 1, a random prompt; `model.generate` greedy with its recurrent cache, timed with
max_new_tokens = N and = 1 (the prefill and first token), so decode tokens/s = (N − 1) / (t_N − t_1), median of
--repeats after a warm-up. transformers uses mamba_ssm's / causal_conv1d's CUDA kernels when they are installed,
else its PyTorch path (the line says which). Prints one line: PEER_DECODE ... tokens_per_s=...
Needs torch and transformers (test-time tools, never mambactl's dependencies).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="mamba1", choices=["mamba1", "mamba2"])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=50280)
    p.add_argument("--d-state", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    torch.manual_seed(0)
    if a.arch == "mamba1":
        from transformers import MambaConfig, MambaForCausalLM
        model = MambaForCausalLM(MambaConfig(vocab_size=a.vocab, hidden_size=a.d_model, num_hidden_layers=a.layers,
                                             state_size=a.d_state))
    else:
        from transformers import Mamba2Config, Mamba2ForCausalLM
        model = Mamba2ForCausalLM(Mamba2Config(vocab_size=a.vocab, hidden_size=a.d_model, num_hidden_layers=a.layers,
                                               state_size=a.d_state, num_heads=2 * a.d_model // 64, head_dim=64,
                                               n_groups=1, chunk_size=64))
    dev = torch.device(a.device)
    model.to(dev).eval()
    prompt = torch.randint(0, a.vocab, (1, a.prompt_len), device=dev)

    def timed(n: int) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                                 pad_token_id=0)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == a.prompt_len + n
        return time.perf_counter() - t

    timed(a.new_tokens)  # warm-up
    runs = []
    for _ in range(a.repeats):
        first, full = timed(1), timed(a.new_tokens)
        runs.append((first, full))
    first = statistics.median(r[0] for r in runs)
    decode = statistics.median(r[1] - r[0] for r in runs)
    kernels = "cuda kernels" if importlib.util.find_spec("mamba_ssm") else "torch path"
    print(f"PEER_DECODE impl=hf arch={a.arch} device={dev.type} kernels={kernels!r} prefill_s={first:.4f} "
          f"step_ms={decode / (a.new_tokens - 1) * 1e3:.3f} tokens_per_s={(a.new_tokens - 1) / decode:.1f}")


if __name__ == "__main__":
    main()
