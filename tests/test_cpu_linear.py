"""Our CPU linear (engine.kernels.cpu_linear): each row's bits do not depend on how many rows
share the call, nor on the instruction set (AVX-512, AVX2 + FMA, scalar): the property that
lets decode, verify and batched passes agree, and a fallback ISA give the same text."""
import pytest
import torch
import torch.nn.functional as F

from engine import cpu_features
from engine.kernels import cpu_linear
from tests.kernels_required import every_test_needs

_needs_kernel = every_test_needs(cpu_linear.refusal, "our CPU linear")
RUNNABLE = [isa for isa, needs in cpu_linear.NEEDS.items() if all(f in cpu_features.flags() for f in needs)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_1_2_17_64_get_the_same_bits_on_every_instruction_set(dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 200, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(64, 200, generator=gen).to(dtype)
    packed = cpu_linear.pack(weight)
    reference = torch.ops.workbench_cpu.linear(x, packed, bias, cpu_linear.ISAS["scalar"])
    torch.testing.assert_close(reference.float(), F.linear(x.float(), weight.float(), bias.float()),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-4)
    for isa in RUNNABLE:
        for rows in (1, 2, 17, 64):
            got = torch.ops.workbench_cpu.linear(x[:rows], packed, bias, cpu_linear.ISAS[isa])
            assert got.dtype == dtype and torch.equal(got, reference[:rows]), f"{isa}, {rows} rows"


def test_packing_is_lossless_and_refuses_a_width_that_is_not_whole_blocks():
    weight = torch.randn(64, 48)
    assert torch.equal(cpu_linear.unpack(cpu_linear.pack(weight)), weight)
    assert cpu_linear.packable(weight) and not cpu_linear.packable(torch.randn(40, 48))


def test_forcing_an_instruction_set_is_checked_and_undone():
    chosen = cpu_linear.isa()
    with pytest.raises(ValueError, match="unknown instruction set"):
        cpu_linear.force_isa("sse9")
    cpu_linear.force_isa("scalar")
    assert cpu_linear.isa() == "scalar"
    cpu_linear.force_isa(None)
    assert cpu_linear.isa() == chosen == RUNNABLE[-1]
