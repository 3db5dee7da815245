"""Model building blocks. Each calls `stoker.kernels.ops`, so the same layer runs the torch
twin on CPU and the Triton kernel on GPU."""
