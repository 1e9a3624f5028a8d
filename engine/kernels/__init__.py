"""Kernels: Triton for the paged KV cache (CUDA; the Triton interpreter on CPU in tests), and
our native CPU linears as torch ops.

store.py            K and V for N tokens into their slots, FP8 quantize-on-store
paged_attention.py  attention over paged KV for the last Q tokens of each sequence
                    (decode, speculative verification, prefill with prefix-cache hits)
dispatch.py         `attention(...)`, the entry point `engine.layers.attention` calls
cpu_linear.py       `workbench_cpu::linear` (cpu_linear.cpp), built at first use: fp32/bf16
                    weights, a row's bits independent of the row count and the ISA
cpu_quant.py        `workbench_cpu::linear_q` (cpu_quant_linear.cpp), in the same library:
                    4-bit and 8-bit group weights, int8 activations, exact integer group dots
cpu_fp8.py          `workbench_cpu::fp8_gather` (cpu_fp8.cpp): the FP8 cache's blocks or slots
                    gathered and dequantized in one pass (the torch attention path's read)
cpu_attention.py    `workbench_cpu::paged_attention` (cpu_attention.cpp): the compiled step's
                    attention on the CPU, every row of a pass over the paged cache as stored

Kernel modules import triton; import them through `dispatch`, which degrades to
`kernels_available() == False` where triton is missing.
"""
import os


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
