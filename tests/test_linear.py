"""The weight-format seam: every format agrees with the dense reference."""

from __future__ import annotations

import pytest
import torch

from specdecode.model.linear import DenseLinear, PackedLinear, _onednn_bf16, make_linear


def test_fp32_weights_stay_dense() -> None:
    assert isinstance(make_linear(torch.randn(8, 4)), DenseLinear)


@pytest.mark.skipif(not _onednn_bf16(), reason="this CPU build has no oneDNN bf16 support")
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 5, 64), (7, 64)])
def test_packed_bf16_matches_dense(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 64, generator=gen).bfloat16()
    bias = torch.randn(300, generator=gen).bfloat16()
    x = torch.randn(shape, generator=gen).bfloat16()
    packed = make_linear(weight.clone(), bias)
    assert isinstance(packed, PackedLinear)
    expected = DenseLinear(weight, bias)(x)
    got = packed(x)
    assert got.shape == (*shape[:-1], 300) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1e-2)
