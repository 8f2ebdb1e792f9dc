"""Float64 numpy mirrors of every op and model: the oracle for the GPU tests, never a runtime path.

Module and function names match `mambactl.ops` and `kernels/` (linear.py <-> ops/linear.py <-> linear.wgsl).
Each op has `name(...)` and `name_backward(saved inputs..., dy)`; written for clarity, not speed.
"""
