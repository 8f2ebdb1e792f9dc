"""`mambactl import` and `mambactl export`: packages from and to transformers, mamba_ssm and GGUF."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text

from mambactl.cli.app import app
from mambactl.errors import MambactlError
from mambactl.interop import export_gguf, export_hf, export_mamba_ssm, import_checkpoint
from mambactl.package.evermind import load

FORMATS = ("hf", "gguf", "mamba_ssm")


@app.command("import")
def import_cmd(
    src: Path = typer.Argument(..., help="A transformers (MambaForCausalLM / Mamba2ForCausalLM) or mamba_ssm model "
                                         "directory (Mamba1/2/3 layers, MHA hybrids): config.json + weights "
                                         "(+ tokenizer.json)."),
    out: Path = typer.Option(..., "-o", "--out", help="The .evermind file to write."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="Tokenizer file or directory (default: the "
                                          "one in SRC; mamba_ssm releases ship none)."),
    name: str | None = typer.Option(None, "--name", help="Package name (default: SRC's directory name)."),
    version: str = typer.Option("0.1.0", "--version", help="Package version."),
) -> None:
    """Import a published checkpoint as a .evermind package (to fine-tune or sample from)."""
    manifest = import_checkpoint(src, out, tokenizer=tokenizer, name=name, version=version)
    config = manifest["config"]
    counts = Counter(config["layers"])
    layers = (f"{config['n_layer']} {config['layers'][0]} layers" if len(counts) == 1 else
              f"{config['n_layer']} layers ({', '.join(f'{n} {kind}' for kind, n in counts.items())})")
    Console().print(Text(f"wrote {out}: {manifest['param_count']:,} parameters, {layers}, "
                         f"vocab {config['vocab_size']}"))


@app.command("export")
def export_cmd(
    package: Path = typer.Argument(..., help="The .evermind file."),
    fmt: str = typer.Option(..., "--format", help="hf (a transformers directory), mamba_ssm (a mamba_ssm "
                                                   "directory) or gguf (one llama.cpp file)."),
    out: Path = typer.Option(..., "-o", "--out", help="The directory (hf, mamba_ssm) or .gguf file (gguf) to "
                                                      "write."),
    dtype: str = typer.Option("f32", "--dtype", help="GGUF weight type: f32 or f16 (hf and mamba_ssm are always "
                                                     "float32)."),
) -> None:
    """Export a package for transformers (`from_pretrained`), mamba_ssm (`MambaLMHeadModel.from_pretrained`) or
    llama.cpp (GGUF v3)."""
    fmt, dtype = fmt.lower(), dtype.lower()
    if fmt not in FORMATS:
        raise MambactlError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt != "gguf" and dtype != "f32":
        raise MambactlError(f"--dtype applies to --format gguf only; {fmt} exports are float32")
    pkg = load(package)
    console = Console()
    if fmt == "hf":
        export_hf(pkg, out)
        console.print(Text(f"wrote {out}/: config.json, model.safetensors, tokenizer.json, tokenizer_config.json"))
        return
    if fmt == "mamba_ssm":
        files = export_mamba_ssm(pkg, out)
        console.print(Text(f"wrote {out}/: {', '.join(f.name for f in files)}"))
        return
    facts = export_gguf(pkg, out, dtype)
    console.print(Text(f"wrote {out}: GGUF v3, {facts['architecture']}, {facts['tensors']} tensors, "
                       f"{facts['file_type']}"))
    if facts["pre"] == "default":
        console.print(Text("warning: the tokenizer's pre-tokenizer is not GPT-2's; llama.cpp will split text with "
                           "its default regex, which may tokenize some text differently", style="yellow"))
