"""The training loop: config -> tokenizer and token cache -> GPU model -> AdamW steps -> package.

Read top to bottom: `train()` prepares everything, then each step draws `grad_accum` micro-batches,
records forward + backward + optimizer into the GPU command stream (submitted in batches as it is recorded,
no host round trip). The host reads the
loss and optimizer counters back only every `log_every` steps.

Under `mpirun` with two or more ranks (mambactl/train/distributed.py, docs/distributed.md), the same loop runs
on every rank with `dist` set: each rank keeps its share of every global batch, the gradients are summed over
the ranks before the optimizer step, and rank 0 alone prints, logs, checkpoints and packages. With `dist` None
(no MPI launcher, or one rank) every `if dist` branch is skipped: the single-process path.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from mambactl.errors import MambactlError
from mambactl.generate import generate
from mambactl.models.lm import EMBED, LanguageModel
from mambactl.models.params import init_parameters, parameter_specs
from mambactl.ops.adamw import AdamWState, adamw_step
from mambactl.package import evermind
from mambactl.package.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer, vocab_size
from mambactl.runtime.gpu import get_runtime
from mambactl.train import distributed
from mambactl.train.checkpoint import checkpoint_dirs, load_checkpoint, save_checkpoint
from mambactl.train.config import TrainConfig
from mambactl.train.data import BatchSampler, source_files, split_tokens, tokenize_cached
from mambactl.train.schedule import learning_rate

SAMPLE_PROMPT = "def "
SAMPLE_TOKENS = 24
EVAL_SEED = 1234  # the same validation windows at every evaluation


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    tokens_seen: int
    final_train_loss: float
    final_val_loss: float | None
    tokens_per_s: float
    wall_s: float
    sample: str
    package: Path
    metrics: list = field(default_factory=list)


def _tokenizer(cfg: TrainConfig, run_dir: Path, files, resume: bool, quiet: bool, init_pkg=None):
    saved = run_dir / "tokenizer.json"
    if resume and saved.is_file():
        return load_tokenizer(saved)
    if init_pkg is not None:  # fine-tuning keeps the package's tokenizer: its ids are what the weights know
        return init_pkg.tokenizer
    if cfg.tokenizer.path:
        return load_tokenizer(cfg.tokenizer.path)
    return train_tokenizer(files, cfg.tokenizer.vocab_size, progress=not quiet)


def evaluate(lm: LanguageModel, val_tokens: np.ndarray, batch_size: int, seq_len: int, batches: int,
             dist=None) -> dict:
    """Mean next-token loss, perplexity, bits per token and top-1/top-5 accuracy on fixed validation windows.
    With `dist`, each rank scores its share of every window batch and the sums are added over the ranks."""
    sampler = BatchSampler(val_tokens, batch_size, seq_len, EVAL_SEED)
    total_loss = top1 = top5 = n = 0.0
    V = lm.cfg.vocab_size  # padded rows are never targets; rank only real tokens
    for _ in range(batches):
        ids, targets = sampler.next_batch()
        if dist:
            ids, targets = dist.shard((ids, targets))
        loss, logits, _ = lm.forward(ids, targets)
        scores = logits.numpy()[:, :V]
        t = targets.reshape(-1)
        top = np.argpartition(-scores, 5, axis=1)[:, :5] if V > 5 else np.argsort(-scores, axis=1)
        best = scores.argmax(axis=1)
        top1 += float(np.sum(best == t))
        top5 += float(np.sum(np.any(top == t[:, None], axis=1)))
        total_loss += float(loss.numpy()[0]) * t.size
        n += t.size
    if dist:
        total_loss, top1, top5, n = (float(x) for x in dist.sum([total_loss, top1, top5, n]))
    mean = total_loss / n
    return {"val_loss": mean, "val_ppl": math.exp(min(mean, 700.0)), "bits_per_token": mean / math.log(2),
            "top1": top1 / n, "top5": top5 / n}


def sample_text(lm: LanguageModel, tokenizer, temperature: float, seed: int = 0, prompt: str = SAMPLE_PROMPT,
                n: int = SAMPLE_TOKENS) -> str:
    """prompt + n tokens sampled with recurrent decoding (mambactl/generate.py)."""
    return prompt + generate(lm, tokenizer, prompt, max_tokens=n, temperature=temperature, seed=seed).text


class _Reporter:
    """A rich progress bar on a terminal, plain lines otherwise, nothing with --quiet."""

    def __init__(self, total: int, start: int, quiet: bool):
        self.quiet = quiet
        self.console = Console(stderr=False)
        self.bar = None
        if not quiet and sys.stdout.isatty():
            self.bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self.console)
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def step(self, step: int, info: str | None) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, **({"info": info} if info else {}))
        elif info and not self.quiet:
            self.console.print(f"step {step}: {info}", highlight=False)

    def say(self, text: str) -> None:
        if not self.quiet:
            (self.bar.console if self.bar else self.console).print(text, highlight=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def train(cfg: TrainConfig, *, resume: bool = False, quiet: bool = False, config_text: str | None = None) -> TrainResult:
    dist = distributed.init()
    if dist is None:
        return _train(cfg, resume, quiet, config_text, None)
    return dist.run(_train, cfg, resume, quiet or not dist.is_main, config_text, dist)


def _train(cfg: TrainConfig, resume: bool, quiet: bool, config_text: str | None, dist) -> TrainResult:
    t_start = time.perf_counter()
    loop = cfg.train
    run_dir = Path(loop.out_dir)
    main = dist is None or dist.is_main  # the process that prints, logs, checkpoints and packages
    if dist:
        dist.check_batch(loop.batch_size)
        dist.agree("config", dataclasses.replace(cfg, train=dataclasses.replace(loop, device="auto")).to_toml())
        newest = dist.bcast(checkpoint_dirs(run_dir)[-1] if main and resume and checkpoint_dirs(run_dir) else None)
        if newest is not None and not newest.is_dir():
            raise MambactlError(f"--resume: rank 0's newest checkpoint {newest} is not visible here; put the run "
                                f"directory on a file system every host shares")
    else:
        newest = checkpoint_dirs(run_dir)[-1] if resume and checkpoint_dirs(run_dir) else None
    if resume and newest is None:
        raise MambactlError(f"--resume: no checkpoint under {run_dir / 'checkpoints'}")

    files = source_files(cfg.data)
    init_pkg = evermind.load(cfg.init_from, verify=True) if cfg.init_from else None
    if dist:  # rank 0 trains or loads the tokenizer and fills the token cache first; the others follow
        tokenizer = _tokenizer(cfg, run_dir, files, resume, quiet, init_pkg) if main else None
        tokenizer = Tokenizer.from_str(dist.bcast(tokenizer.to_str() if main else None))
        if main:
            tokenize_cached(files, tokenizer, cfg.data.cache_dir)
        dist.barrier()
    else:
        tokenizer = _tokenizer(cfg, run_dir, files, resume, quiet, init_pkg)
    model_cfg = init_pkg.config if init_pkg is not None else cfg.resolve_model(vocab_size(tokenizer))
    token_file = tokenize_cached(files, tokenizer, cfg.data.cache_dir)
    tokens = token_file.tokens
    train_tokens, val_tokens = split_tokens(tokens, cfg.data.val_fraction, loop.seq_len)
    sampler = BatchSampler(train_tokens, loop.batch_size, loop.seq_len, loop.seed)
    if dist:  # the cache file's name is a SHA-256 of the data and the tokenizer
        dist.agree("tokenized data", (token_file.path.name, len(tokens)))

    if dist:
        rt = get_runtime(dist.device_spec(loop.device))
    else:
        rt = get_runtime(None if loop.device == "auto" else loop.device)
    if loop.matmul_precision == "f16" and "shader-f16" not in rt.features:
        raise MambactlError(f'train.matmul_precision: "f16" needs an adapter with shader-f16; {rt.info.name} '
                            f"({rt.info.backend}) has none")
    specs = parameter_specs(model_cfg)
    start = 0
    if newest is not None:
        ckpt_cfg, weights, opt_arrays, state = load_checkpoint(newest)
        if ckpt_cfg.to_dict() != model_cfg.to_dict():
            raise MambactlError(f"{newest}: the checkpoint's model config differs from this config's [model]")
        start = int(state["step"])
        sampler.load_state_dict(state["sampler"])
    elif init_pkg is not None:
        weights = {k: np.array(v, dtype=np.float32) for k, v in init_pkg.weights.items()}
    else:
        weights = init_parameters(model_cfg, loop.seed)
    lm = LanguageModel(model_cfg, rt, weights)
    params = [lm.params[s.name] for s in specs]
    grads = [lm.grads[s.name] for s in specs]
    no_decay = [s.no_decay and not (cfg.optim.decay_embeddings and s.name == EMBED) for s in specs]
    opt = AdamWState.from_numpy(rt, opt_arrays, params) if newest is not None else AdamWState.zeros(params)
    reducer = distributed.GradReducer(dist, grads) if dist else None

    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tokenizer, run_dir / "tokenizer.json")
        (run_dir / "config.toml").write_text(cfg.to_toml())
    metrics_file = (run_dir / "metrics.jsonl").open("a") if main else None
    total = loop.total_steps
    tokens_per_step = loop.batch_size * loop.seq_len * loop.grad_accum
    reporter = _Reporter(total, start, quiet)
    if dist:
        adapters = dist.allgather(f"{rt.info.name} ({rt.info.backend})")
        where = "; ".join(f"rank {r}: {a}" for r, a in enumerate(adapters))
        reporter.say(f"training {model_cfg.n_layer}-layer d_model={model_cfg.d_model} vocab={model_cfg.vocab_size} "
                     f"on {dist.world} MPI ranks ({where}); global batch {loop.batch_size}; "
                     f"{len(train_tokens):,} train / {len(val_tokens):,} val tokens")
    else:
        reporter.say(f"training {model_cfg.n_layer}-layer d_model={model_cfg.d_model} vocab={model_cfg.vocab_size} "
                     f"on {rt.info.name} ({rt.info.backend}); {len(train_tokens):,} train / {len(val_tokens):,} val tokens")
    metrics: list[dict] = []

    def log(event: dict) -> None:
        metrics.append(event)
        if not main:
            return
        metrics_file.write(json.dumps(event) + "\n")
        metrics_file.flush()

    def checkpoint(step: int) -> None:
        if not main:
            return
        state = {"step": step, "sampler": sampler.state_dict(), "tokens_seen": step * tokens_per_step}
        save_checkpoint(run_dir, step, model_cfg, lm.weights_numpy(), opt.to_numpy(), state, loop.keep_checkpoints)

    smoothed = None
    last_val = None
    train_loss = float("nan")
    window_t, window_step = time.perf_counter(), start
    step = start
    previous_precision, rt.matmul_precision = rt.matmul_precision, loop.matmul_precision  # the training GEMMs
    try:
        while step < total:
            lm.zero_grad()
            batches = [sampler.next_batch() for _ in range(loop.grad_accum)]
            count = sum(int(t.size) for _, t in batches)
            if dist:  # count stays the global batch's: the ranks' gradients add up to the global mean's
                dist.check_test_failure(step)
                global_counts = np.array([t.size for _, t in batches], np.float64)
                batches = [dist.shard(b) for b in batches]
            losses = []
            for ids, targets in batches:
                loss, _, saved = lm.forward(ids, targets)
                lm.backward(saved, grad_count=count)
                losses.append(loss)
                del saved
            if dist:
                reducer.allreduce()  # written back into `grads` before adamw_step records the global norm
            lr = learning_rate(step, cfg)
            adamw_step(params, grads, opt, lr=lr, beta1=cfg.optim.betas[0], beta2=cfg.optim.betas[1],
                       eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay, no_decay=no_decay,
                       max_grad_norm=cfg.optim.grad_clip, max_delta=cfg.optim.max_delta)
            rt.flush()
            step += 1
            info = None
            if step % loop.log_every == 0 or step == total:
                if dist:  # the global mean of each micro-batch, weighted by each rank's targets
                    sums = dist.sum([float(l.numpy()[0]) * t.size for l, (_, t) in zip(losses, batches)])
                    train_loss = float(np.mean(sums / global_counts))
                else:
                    train_loss = float(np.mean([l.numpy()[0] for l in losses]))
                counters = opt.read_counters()
                now = time.perf_counter()
                tps = (step - window_step) * tokens_per_step / max(now - window_t, 1e-9)
                window_t, window_step = now, step
                smoothed = train_loss if smoothed is None else 0.7 * smoothed + 0.3 * train_loss
                event = {"event": "train", "step": step, "train_loss": train_loss, "lr": lr,
                         "grad_norm": counters["grad_norm"], "tokens_per_s": tps,
                         "skipped_steps": counters["skipped_steps"], "bad_elements": counters["bad_elements"]}
                log(event)
                info = f"loss {smoothed:.4f}  lr {lr:.2e}  |g| {counters['grad_norm']:.3f}  {tps:,.0f} tok/s"
                if counters["skipped_steps"] or counters["bad_elements"]:
                    info += f"  skipped {counters['skipped_steps']} bad {counters['bad_elements']}"
            if loop.eval_every and (step % loop.eval_every == 0 or step == total):
                ev = evaluate(lm, val_tokens, loop.batch_size, loop.seq_len, loop.eval_batches, dist)
                ev["sample"] = sample_text(lm, tokenizer, temperature=0.0) if main else ""
                last_val = ev["val_loss"]
                log({"event": "eval", "step": step, **ev})
                reporter.say(f"eval @ {step}: val_loss {ev['val_loss']:.4f} ppl {ev['val_ppl']:.2f} "
                             f"top1 {ev['top1']:.3f} top5 {ev['top5']:.3f} | sample: {ev['sample']!r}")
            if (loop.checkpoint_every and step % loop.checkpoint_every == 0) or step == total:
                checkpoint(step)
            reporter.step(step, info)
    except KeyboardInterrupt:
        reporter.close()
        checkpoint(step)
        if main:
            metrics_file.close()
        raise MambactlError(f"interrupted at step {step}; checkpoint written, continue with --resume") from None
    finally:
        rt.matmul_precision = previous_precision  # the runtime is shared: sampling and later work get it back
    reporter.close()
    if main:
        metrics_file.close()

    # The final sample is drawn (temperature 0.8, seeded) rather than greedy: a small model's greedy text
    # soon repeats one token, which says little about what it learned.
    sample = sample_text(lm, tokenizer, temperature=0.8, seed=loop.seed) if main else ""
    wall = time.perf_counter() - t_start
    trained = total - start
    package_path = run_dir / "model.evermind"
    if not main:
        return TrainResult(run_dir, total, total * tokens_per_step, train_loss, last_val,
                           trained * tokens_per_step / max(wall, 1e-9), wall, sample, package_path, metrics)
    final_losses = {"train_loss": train_loss} if math.isfinite(train_loss) else {}
    if last_val is not None:
        final_losses["val_loss"] = last_val
    evermind.write_package(
        package_path, model_cfg, lm.weights_numpy(), tokenizer, name=cfg.package.name, version=cfg.package.version,
        card={"description": cfg.package.description, "license": cfg.package.license or None,
              "author": cfg.package.author or None, "tags": list(cfg.package.tags),
              "training_summary": f"{total} steps, {total * tokens_per_step:,} tokens, batch {loop.batch_size}x"
                                  f"{loop.seq_len}x{loop.grad_accum}, final train loss {train_loss:.4f}"},
        provenance={"training_config": config_text or cfg.to_toml(), "steps": total,
                    "tokens_seen": total * tokens_per_step, "final_losses": final_losses or None},
    )
    return TrainResult(run_dir, total, total * tokens_per_step, train_loss, last_val,
                       trained * tokens_per_step / max(wall, 1e-9), wall, sample, package_path, metrics)
