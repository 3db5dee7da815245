"""Kernels: each Triton kernel and its typed launcher in its own file; `reference.py` holds
the plain-torch twins, which are also the CPU execution path."""
