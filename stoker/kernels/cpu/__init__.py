"""CPU kernels in C, built at first use (build.py), called through native.py; the torch twins remain the fallback."""
