"""Triton kernels for the paged KV cache (CUDA; the Triton interpreter on CPU in tests).

store.py            K and V for N tokens into their slots, FP8 quantize-on-store
paged_attention.py  attention over paged KV for the last Q tokens of each sequence
                    (decode, speculative verification, prefill with prefix-cache hits)
dispatch.py         `attention(...)`, the entry point `engine.layers.attention` calls

Kernel modules import triton; import them through `dispatch`, which degrades to
`kernels_available() == False` where triton is missing.
"""
import os


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
