"""`mambactl pack`, `mambactl inspect` and `mambactl tokenizer train|encode|decode`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text
from tokenizers import Tokenizer

from mambactl.cli.app import app
from mambactl.errors import MambactlError
from mambactl.package.checkpoint import TOKENIZER_FILE, checkpoint_provenance, find_beside, load_checkpoint_weights
from mambactl.package.evermind import WRITE_DTYPES, describe, load, write_package
from mambactl.package.tokenizer import (DEFAULT_SPECIALS, decode, encode, load_tokenizer, save_tokenizer,
                                        tokenizer_summary, train_tokenizer)

tokenizer_app = typer.Typer(help="Train and try byte-level BPE tokenizers.", no_args_is_help=True)
app.add_typer(tokenizer_app, name="tokenizer")


@app.command()
def pack(
    checkpoint: Path = typer.Argument(..., help="Checkpoint or run directory (model.safetensors + model.json), "
                                                "or a .safetensors file (with --config)."),
    out: Path = typer.Option(..., "-o", "--out", help="The .evermind file to write."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="tokenizer.json, vocab.json (+ merges.txt), "
                                          "a directory or an old-engine spec (default: tokenizer.json beside it)."),
    config: Path | None = typer.Option(None, "--config", help="model.json for a bare .safetensors file."),
    name: str | None = typer.Option(None, "--name", help="Package name (default: the output file's stem)."),
    version: str = typer.Option("0.1.0", "--version", help="Package version."),
    description: str = typer.Option("", "--description", help="Model card description."),
    license_name: str | None = typer.Option(None, "--license", help="Model card license, e.g. MIT."),
    author: str | None = typer.Option(None, "--author", help="Model card author."),
    tag: list[str] = typer.Option([], "--tag", help="Model card tag (repeatable)."),
    dtype: str = typer.Option("F32", "--dtype", help=f"Stored weight dtype: {', '.join(WRITE_DTYPES)}."),
) -> None:
    """Package a checkpoint and its tokenizer as one verified .evermind file."""
    model_config, weights = load_checkpoint_weights(checkpoint, config)
    tokenizer_path = tokenizer or find_beside(checkpoint, TOKENIZER_FILE)
    if tokenizer_path is None:
        raise MambactlError(f"{checkpoint}: no {TOKENIZER_FILE} beside the checkpoint; pass --tokenizer")
    manifest = write_package(
        out, model_config, weights, load_tokenizer(tokenizer_path),
        name=name or out.stem, version=version,
        card={"description": description, "license": license_name, "author": author, "tags": tag},
        provenance=checkpoint_provenance(checkpoint), dtype=dtype.upper(),
    )
    Console().print(Text(f"wrote {out}: {manifest['param_count']:,} parameters ({manifest['dtype']}), "
                         f"{_human(out.stat().st_size)}"))


@app.command()
def inspect(
    package: Path = typer.Argument(..., help="The .evermind file."),
    verify: bool = typer.Option(False, "--verify", help="Re-hash every section; fail naming the first bad one."),
    as_json: bool = typer.Option(False, "--json", help="Print the facts as one JSON object."),
) -> None:
    """Show a package: header, card, architecture, parameters, tokenizer and sections."""
    facts = describe(package, verify=verify)
    if as_json:
        typer.echo(json.dumps(facts, indent=2))
    else:
        _render(facts, Console())


# tokenizer sub-commands -----------------------------------------------------------------------------------------
@tokenizer_app.command("train")
def tokenizer_train(
    files: list[Path] = typer.Argument(..., help="UTF-8 text files."),
    vocab_size: int = typer.Option(..., "--vocab-size", help="Vocabulary size, specials and byte symbols included."),
    out: Path = typer.Option(..., "-o", "--out", help="The tokenizer.json to write."),
    special: list[str] = typer.Option([], "--special", help="Special token (repeatable, ids 0, 1, ...); "
                                      f"replaces the defaults {' '.join(DEFAULT_SPECIALS)}."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show training progress."),
) -> None:
    """Train a byte-level BPE tokenizer."""
    tok = train_tokenizer(files, vocab_size, specials=special or DEFAULT_SPECIALS, progress=progress)
    save_tokenizer(tok, out)
    summary = tokenizer_summary(tok)
    specials = ", ".join(f"{t} ({i})" for t, i in summary["specials"].items())
    Console().print(Text(f"wrote {out}: {summary['vocab_size']} tokens; specials {specials or 'none'}"))


@tokenizer_app.command("encode")
def tokenizer_encode(
    tokenizer: Path = typer.Argument(..., help="A tokenizer (any format `pack --tokenizer` takes) or a .evermind."),
    text: str | None = typer.Argument(None, help="Text to encode (default: standard input)."),
    as_json: bool = typer.Option(False, "--json", help='Print {"ids": [...], "tokens": [...]}.'),
) -> None:
    """Print the token ids of a text, space-separated."""
    tok = _tokenizer(tokenizer)
    ids = encode(tok, sys.stdin.read() if text is None else text)
    if as_json:
        typer.echo(json.dumps({"ids": ids, "tokens": [tok.id_to_token(i) for i in ids]}, ensure_ascii=False))
    else:
        typer.echo(" ".join(map(str, ids)))


@tokenizer_app.command("decode")
def tokenizer_decode(
    tokenizer: Path = typer.Argument(..., help="A tokenizer (any format `pack --tokenizer` takes) or a .evermind."),
    ids: list[str] = typer.Argument(None, help="Token ids (default: whitespace-separated on standard input)."),
) -> None:
    """Print the text of token ids."""
    words = ids if ids else sys.stdin.read().split()
    bad = next((w for w in words if not w.isdecimal()), None)
    if bad is not None:
        raise MambactlError(f"not a token id: {bad!r}")
    typer.echo(decode(_tokenizer(tokenizer), [int(w) for w in words]))


def _tokenizer(path: Path) -> Tokenizer:
    return load(path, verify=False).tokenizer if path.suffix == ".evermind" else load_tokenizer(path)


# rendering ------------------------------------------------------------------------------------------------------
def _human(n: float) -> str:
    """A byte count for people: 512 B, 1.5 KiB, 3.2 MiB, ..."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            break
    return f"{n:.1f} {unit}"


def _fields(title: str, rows: list[tuple[str, object]]) -> Table:
    """A two-column key/value table; values are shown as plain text (never rich markup)."""
    table = Table(title=Text(title), show_header=False, title_justify="left", title_style="bold")
    table.add_column(style="cyan")
    table.add_column()
    for key, value in rows:
        if value is None or value == "" or value == []:
            shown = "-"
        elif isinstance(value, list):
            shown = ", ".join(map(str, value))
        else:
            shown = json.dumps(value) if isinstance(value, dict) else str(value)
        table.add_row(Text(key), Text(shown))
    return table


def _render(facts: dict, console: Console) -> None:
    m = facts["manifest"]
    if not facts["loadable"]:
        console.print(_fields(f"{facts['file']} (evermind v{facts['format_version']})", list(m.items())))
        console.print(Text(f"note: {facts['note']}", style="yellow"))
        return
    card, prov, tok = m["card"], m["provenance"], facts["tokenizer"]
    console.print(_fields(facts["file"], [
        ("name", m["name"]), ("version", m["version"]), ("schema", m["schema"]), ("model type", m["model_type"]),
        ("parameters", f"{m['param_count']:,}"), ("dtype", m["dtype"]), ("size", _human(facts["size"])),
        ("created", m["created_at"]),
        ("verified", "yes, every section's SHA-256 matches" if facts["verified"] else "not checked (--verify)"),
    ]))
    console.print(_fields("card", [("description", card["description"]), ("license", card["license"]),
                                   ("author", card["author"]), ("tags", card["tags"]),
                                   ("training summary", card["training_summary"])]))
    config = dict(m["config"])
    mixer = config.pop("mamba1")
    console.print(_fields("architecture", [*config.items(), *((f"mamba1.{k}", v) for k, v in mixer.items())]))

    params = Table(title="parameters", title_justify="left", title_style="bold")
    for col in ("layer", "tensor", "shape", "count"):
        params.add_column(col, justify="right" if col == "count" else "left")
    previous = None
    for p in facts["parameters"]:
        index, _, rest = p["name"].removeprefix("backbone.layers.").partition(".")
        layer = f"{index} {config['layers'][int(index)]}" if p["name"].startswith("backbone.layers.") else ""
        if layer != previous and previous is not None:
            params.add_section()
        params.add_row(layer, Text(rest if layer else p["name"]), " x ".join(map(str, p["shape"])),
                       f"{p['count']:,}")
        previous = layer
    params.add_section()
    params.add_row("", Text("total", style="bold"), "", f"{m['param_count']:,}")
    console.print(params)

    specials = ", ".join(f"{t} ({i})" for t, i in tok["specials"].items())
    console.print(_fields("tokenizer", [("type", tok["type"]), ("vocab size", tok["vocab_size"]),
                                        ("specials", specials)]))
    sections = Table(title="sections", title_justify="left", title_style="bold")
    for col in ("name", "format", "offset", "length", "sha256"):
        sections.add_column(col, justify="right" if col in ("offset", "length") else "left",
                            overflow="fold")
    for s in m["sections"]:
        sections.add_row(Text(s["name"]), Text(s["format"]), f"{s['offset']:,}", _human(s["length"]), s["sha256"])
    console.print(sections)
    training_config = prov["training_config"]
    console.print(_fields("provenance", [
        ("mambactl", prov["mambactl_version"]), ("steps", prov["steps"]), ("tokens seen", prov["tokens_seen"]),
        ("final losses", ", ".join(f"{k} {v:.4f}" for k, v in (prov["final_losses"] or {}).items())),
        ("training config", f"{len(training_config.splitlines())} lines of TOML" if training_config else None),
    ]))
