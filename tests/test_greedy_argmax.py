"""sampler.greedy, the argmax of every greedy step and verify: torch.argmax's answer (the
first index of the largest value, a NaN counting as the largest) on the CPU's fast path
(numpy, float logits) and on torch's (other dtypes), for one row and for many."""
import pytest
import torch

from engine.layers.sampler import greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_greedy_is_torch_argmax_with_ties_and_nans(dtype):
    gen = torch.Generator().manual_seed(0)
    rows = (torch.randn(64, 49152, generator=gen) * 4).round().to(dtype)       # rounded: many ties
    rows[3, 100] = rows[3, 7] = rows[3].max() + 1                             # a tie for the largest: the first wins
    rows[5, 40000] = float("nan")                                             # NaN counts as the largest
    rows[6, 9] = rows[6, 3] = float("nan")
    rows[7] = float("-inf")
    rows[8, :] = 0
    want = torch.argmax(rows, dim=-1).tolist()
    assert greedy(rows) == want
    assert [greedy(row) for row in rows] == want
    assert isinstance(greedy(rows[0]), int) and greedy(rows[3]) == 7 and greedy(rows[5]) == 40000 and greedy(rows[6]) == 3


def test_greedy_takes_a_view_and_an_inference_tensor():
    with torch.inference_mode():
        logits = torch.randn(4, 1000)
    assert greedy(logits[1:3]) == torch.argmax(logits[1:3], -1).tolist()
    assert greedy(logits.t()[7]) == int(torch.argmax(logits.t()[7]))        # a strided row
