"""`mambactl devices`: list the adapters wgpu sees."""
