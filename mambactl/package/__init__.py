"""Tokenizers, checkpoint directories and the `.evermind` package (docs/evermind-format.md)."""

from mambactl.package.checkpoint import load_checkpoint_weights, save_checkpoint_weights
from mambactl.package.evermind import Package, describe, load, read_manifest, verify, write_package
from mambactl.package.tokenizer import load_tokenizer, tokenizer_summary, train_tokenizer

__all__ = [
    "Package",
    "describe",
    "load",
    "load_checkpoint_weights",
    "load_tokenizer",
    "read_manifest",
    "save_checkpoint_weights",
    "tokenizer_summary",
    "train_tokenizer",
    "verify",
    "write_package",
]
