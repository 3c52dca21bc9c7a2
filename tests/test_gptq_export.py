"""The 4-bit GPTQ checkpoint `bench/gptq.py` writes for vLLM's `bits=4`: its bit layout, its
values, and the folder it writes from a model folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specdecode.bench import gptq
from specdecode.errors import UserError


def test_the_layout_is_gptqs_eight_values_a_word_low_bits_first() -> None:
    """A group whose largest |w| is 7.5 has scale 1, so q = round(w) + 8 is known by hand."""
    q = torch.randint(1, 16, (8, 32))  # [out, in]: w = q - 8 in -7..7
    weight = (q - 8).float()
    weight[:, 0] = 7.5  # |w| max 7.5 in every row's group: scale = 2 * 7.5 / 15 = 1
    q[:, 0] = 15  # round(7.5) = 8 (to even), + 8 = 16, clamped to 15
    tensors = gptq.quantize(weight, 32)
    assert tensors["scales"].shape == (1, 8) and torch.all(tensors["scales"] == 1)
    for row in range(4):  # word `row` of output 3 holds inputs 8 row .. 8 row + 7
        word = sum(int(q[3, 8 * row + j]) << (4 * j) for j in range(8))
        assert tensors["qweight"][row, 3].item() & 0xFFFFFFFF == word
    assert tensors["qzeros"].shape == (1, 1) and tensors["qzeros"].item() == 0x77777777
    assert tensors["g_idx"].tolist() == [0] * 32


def test_round_to_nearest_is_within_half_a_step_of_every_weight() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 256) * torch.rand(64, 1)  # rows of different ranges
    tensors = gptq.quantize(weight, 128)
    assert tensors["qweight"].shape == (32, 64) and tensors["scales"].shape == (2, 64)
    step = tensors["scales"].float().t().repeat_interleave(128, dim=1)  # [out, in]
    error = (gptq.dequantize(tensors) - weight).abs()
    # half a step, and the scale's fp16 rounding (2^-11 of it) at |w| up to 7.5 steps
    assert torch.all(error <= step * (0.5 + 7.5 * 2**-11) + 1e-6)
    assert error.max() > step.max() / 8  # not trivially exact: a real 4-bit grid


def test_a_weight_that_splits_into_no_group_is_refused() -> None:
    with pytest.raises(UserError, match=r"a 8x48 weight does not split"):
        gptq.quantize(torch.ones(8, 48), 32)


def test_a_model_folder_is_written_as_a_gptq_checkpoint_once(tiny_model_dir: Path) -> None:
    out = gptq.exported(tiny_model_dir)
    assert out == tiny_model_dir / gptq.FOLDER
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config == gptq.quantization_config(64)  # the tiny model's widths are 64 and 128
    assert (out / "tokenizer.json").is_file()
    with (
        safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as source,
        safe_open(str(out / "model.safetensors"), framework="pt") as written,
    ):
        names = set(written.keys())
        down = "model.layers.0.mlp.down_proj"
        assert {f"{down}.{p}" for p in ("qweight", "scales", "qzeros", "g_idx")} <= names
        assert f"{down}.weight" not in names
        parts = {p: written.get_tensor(f"{down}.{p}") for p in ("qweight", "scales", "qzeros")}
        parts["g_idx"] = written.get_tensor(f"{down}.g_idx")
        original = source.get_tensor(f"{down}.weight").float()
        step = parts["scales"].float().max()
        assert (gptq.dequantize(parts) - original).abs().max() <= step * (0.5 + 7.5 * 2**-11)
        for kept in ("model.embed_tokens.weight", "model.norm.weight"):
            assert torch.equal(written.get_tensor(kept), source.get_tensor(kept))
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert gptq.exported(tiny_model_dir) == out  # written once, then reused
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
