"""Kernels: Triton for the paged KV cache (CUDA; the Triton interpreter on CPU in tests), and
our native CPU linears as torch ops.

store.py            K and V for N tokens into their slots, FP8 quantize-on-store
paged_attention.py  attention over paged KV for the last Q tokens of each sequence
                    (decode, speculative verification, prefill with prefix-cache hits)
dispatch.py         the entry points `engine.layers.attention` calls: store a pass's K/V, attend
                    a batch of decode rows in one launch, or one sequence alone
cpu_linear.py       `workbench_cpu::linear` (cpu_linear.cpp), built at first use: fp32/bf16
                    weights, a row's bits independent of the row count and the ISA
cpu_quant.py        `workbench_cpu::linear_q` (cpu_quant_linear.cpp), in the same library:
                    4-bit and 8-bit group weights, int8 activations, exact integer group dots
cpu_fp8.py          `workbench_cpu::fp8_gather` (cpu_fp8.cpp): the FP8 cache's blocks or slots
                    gathered and dequantized in one pass (the torch attention path's read)
cpu_attention.py    `workbench_cpu::paged_attention` (cpu_attention.cpp): the compiled step's
                    attention on the CPU, every row of a pass over the paged cache as stored
gpu_quant.py        the GPU's quantized linears on weights as stored (GGUF blocks, AWQ/GPTQ
                    int4): whether they run here, their trial, the entry points; the layouts in
                    gpu_quant_layouts.py, the Triton kernels in gpu_quant_linear.py

Kernel modules import triton; import them through `dispatch`, which degrades to
`kernels_available() == False` where triton is missing. `mend_interpreter` lets the Triton
interpreter (tests) run loops with runtime bounds under numpy >= 2.4.
"""
import os


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def mend_interpreter() -> None:
    """Let the Triton interpreter take a tensor as a loop bound under numpy >= 2.4.

    The interpreter holds a scalar as a one-element array and turns it into a Python int for
    `range` with int(array); numpy 2.4 refuses that for an array with a dimension ("only
    0-dimensional arrays can be converted to Python scalars"), so every kernel loop whose bound
    is a runtime value failed there (triton 3.6; 3.9 takes the element itself). Under the
    interpreter only, and only where numpy refuses, each launch's tensor patch is followed by
    one that takes the element (the interpreter undoes both after the launch); compiled
    kernels are untouched."""
    if not interpreting():
        return
    import numpy
    if numpy.lib.NumpyVersion(numpy.__version__) < "2.4.0":
        return
    from triton.runtime import interpreter
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "takes_the_element", False):
        return

    def index(self) -> int:
        return int(self.handle.data.item())

    def patch_then_take_the_element(tensor, *scope):
        patch_tensor(tensor, *scope)
        if scope:           # the launch's scope undoes what it set, last first
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patch_then_take_the_element.takes_the_element = True
    interpreter._patch_lang_tensor = patch_then_take_the_element
