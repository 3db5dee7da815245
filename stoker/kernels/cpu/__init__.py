"""CPU kernels in C, built at first use (see native.py); the torch twins remain the fallback."""
