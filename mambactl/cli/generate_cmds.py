"""`mambactl generate` and `mambactl eval`: use a trained package."""

import json
import sys
import tomllib
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import Progress

from mambactl.cli.app import app
from mambactl.evaluate import evaluate_tokens
from mambactl.generate import generate as run_generation
from mambactl.models.lm import LanguageModel
from mambactl.package import load
from mambactl.runtime.gpu import get_runtime
from mambactl.train.data import iter_documents, resolve_sources

DEFAULT_WINDOW = 1024


def _model(package: Path, device: Optional[str]):
    pkg = load(package, verify=True)
    return pkg, LanguageModel(pkg.config, get_runtime(device), pkg.weights)


def _training_window(manifest: dict) -> int:
    """The sequence length the model was trained with, from the package's provenance, else DEFAULT_WINDOW."""
    text = (manifest.get("provenance") or {}).get("training_config") or ""
    try:
        return int(tomllib.loads(text)["train"]["seq_len"])
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError):
        return DEFAULT_WINDOW


@app.command()
def generate(
    package: Path = typer.Argument(..., help="A .evermind package."),
    prompt: str = typer.Option("", "--prompt", "-p", help="Text to continue (empty: start a new document)."),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", help="New tokens to generate."),
    temperature: float = typer.Option(0.8, "--temperature", "-t", help="0 = greedy."),
    top_k: int = typer.Option(50, "--top-k", help="Sample from the k most likely tokens (0 = all)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same text."),
    stop: List[str] = typer.Option([], "--stop", help="Stop before this string (repeatable)."),
    device: Optional[str] = typer.Option(None, "--device", help="Adapter index or name."),
) -> None:
    """Generate text from a package, streaming tokens as they are produced."""
    pkg, lm = _model(package, device)
    sys.stdout.write(prompt)
    sys.stdout.flush()

    def emit(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = run_generation(lm, pkg.tokenizer, prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seed, stop=list(stop), on_text=emit)
    sys.stdout.write("\n")
    Console(stderr=True).print(
        f"[dim]{len(result.tokens)} tokens after a {result.prompt_tokens}-token prompt, "
        f"{result.decode_tokens_per_s:,.1f} tokens/s decode, stopped by {result.stopped_by}[/]")


@app.command("eval")
def eval_cmd(
    package: Path = typer.Argument(..., help="A .evermind package."),
    data: List[str] = typer.Argument(..., help="Text files, globs, directories or .jsonl (a `text` field)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    window: Optional[int] = typer.Option(None, "--window", help="Context window (default: the training length)."),
    device: Optional[str] = typer.Option(None, "--device", help="Adapter index or name."),
) -> None:
    """Score a package on text: loss, perplexity, bits per token, top-1/top-5 accuracy."""
    pkg, lm = _model(package, device)
    docs = [pkg.tokenizer.encode(text, add_special_tokens=False).ids for text in iter_documents(resolve_sources(data))]
    win = window or _training_window(pkg.manifest)
    with Progress(transient=True, console=Console(stderr=True), disable=as_json or not sys.stderr.isatty()) as bar:
        task = bar.add_task("scoring", total=None)
        result = evaluate_tokens(lm, docs, win, progress=lambda k, n: bar.update(task, completed=k, total=n))
    if as_json:
        typer.echo(json.dumps(result))
        return
    for key in ("loss", "perplexity", "bits_per_token", "top1", "top5"):
        typer.echo(f"{key:15s} {result[key]:.4f}")
    typer.echo(f"{'tokens':15s} {result['tokens']}")
