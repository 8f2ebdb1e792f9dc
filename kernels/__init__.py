"""WGSL kernel sources, one file per op family (shipped inside the wheel as mambactl.kernels)."""
