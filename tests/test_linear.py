"""The weight-format seam: every dense format agrees with the dense reference."""

from __future__ import annotations

import pytest
import torch
from conftest import runnable_variants, select_variant

from specdecode import kernels
from specdecode.model.linear import (
    Bf16Linear,
    DenseLinear,
    PackedLinear,
    _onednn_bf16,
    make_linear,
)


def test_fp32_weights_stay_dense() -> None:
    assert isinstance(make_linear(torch.randn(8, 4)), DenseLinear)


def test_bf16_weights_on_the_cpu_get_the_native_kernel() -> None:
    assert kernels.available()  # CI builds the kernels; a failed build must not pass silently
    module = make_linear(torch.randn(8, 4).bfloat16())
    assert isinstance(module, Bf16Linear) and module.row_exact


def _case(out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(out, inp, generator=gen).bfloat16(), torch.randn(
        out, generator=gen
    ).bfloat16()


@pytest.mark.parametrize("module_type", [Bf16Linear, PackedLinear])
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 5, 64), (7, 64)])
def test_bf16_modules_match_dense(module_type: type, shape: tuple[int, ...]) -> None:
    if module_type is PackedLinear and not _onednn_bf16():
        pytest.skip("this CPU build has no oneDNN bf16 support")
    weight, bias = _case(300, 64)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    module = module_type(weight.clone(), bias)
    expected = DenseLinear(weight, bias)(x)
    got = module(x)
    assert got.shape == (*shape[:-1], 300) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1e-2)
    assert module.weight_bytes >= weight.nbytes + bias.nbytes


@pytest.mark.parametrize(("out", "inp"), [(300, 64), (5, 3), (130, 97)])
def test_bf16_kernel_sums_in_fp32_and_pads_odd_shapes(out: int, inp: int, kernel_path: str) -> None:
    weight, bias = _case(out, inp)
    x = torch.randn(9, inp, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = Bf16Linear(weight, bias)(x)
    want = x.float() @ weight.float().T + bias.float()  # fp32 sums, one rounding at the end
    torch.testing.assert_close(got.float(), want, atol=0, rtol=2**-8)


@pytest.mark.parametrize(("rows", "inp"), [(9, 96), (70, 96), (6, 300)])
def test_bf16_kernel_is_row_exact(rows: int, inp: int, kernel_path: str) -> None:
    """Each row of a pass gets the bits a 1-row pass gives it (verification needs this), on
    every path (AMX takes 96 input features, 70 rows in chunks of 16; the 256-bit paths take
    300 in chunks of 128, 6 rows as tiles of 3)."""
    weight, bias = _case(130, inp)
    module = Bf16Linear(weight, bias)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(3)).bfloat16()
    alone = torch.cat([module(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(module(x), alone)


@pytest.mark.parametrize("inp", [97, 300])
def test_the_avx2_bf16_kernel_gives_the_portable_bits(
    inp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per pair, odd product then even, each rounded before its addition: the same order (300
    inputs: AVX2 sums them in chunks of 128, the groups taking turns)."""
    if not {"avx2", "portable"} <= set(runnable_variants()):
        pytest.skip("needs the avx2 and portable kernels")
    weight, bias = _case(130, inp)
    x = torch.randn(11, inp, generator=torch.Generator().manual_seed(4)).bfloat16()
    outputs = []
    for name in ("avx2", "portable"):
        select_variant(name, monkeypatch)
        outputs.append(Bf16Linear(weight, bias)(x))
    select_variant("auto", monkeypatch)
    assert torch.equal(outputs[0], outputs[1])
