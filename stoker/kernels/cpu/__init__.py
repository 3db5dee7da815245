"""CPU kernels in C, built at first use (build.py), called through one Python module per C file
(paged_decode_attention.py, prefill_attention.py, elementwise.py, linear.py, store_kvcache.py,
lora.py, encoder_layer.py; what they share in common.py); the torch twins remain the fallback."""
