"""mambactl: train and package Mamba-family language models on any GPU through wgpu."""

__version__ = "0.1.0"
