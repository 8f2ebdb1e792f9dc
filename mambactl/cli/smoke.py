"""`mambactl smoke`: one forward/backward on the GPU checked against the float64 reference."""
