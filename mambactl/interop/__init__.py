"""Interoperability: import transformers / mamba_ssm checkpoints, export to transformers, mamba_ssm and GGUF
(llama.cpp).

Neither torch, transformers nor gguf is needed: tensors are read and written with numpy, safetensors and
mambactl's own torch-zip reader / writer and GGUF writer. See docs/interop.md.
"""

from mambactl.interop.gguf import export_gguf
from mambactl.interop.hf import export_hf, import_checkpoint
from mambactl.interop.mamba_ssm import export_mamba_ssm

__all__ = ["export_gguf", "export_hf", "export_mamba_ssm", "import_checkpoint"]
