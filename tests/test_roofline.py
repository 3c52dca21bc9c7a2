"""Roofline arithmetic: the bytes a decoded token reads, per weight format."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdecode import kernels
from specdecode.bench.costs import achieved_gmacs, pass_table_text
from specdecode.bench.roofline import (
    bytes_per_token,
    madds_per_token,
    roofline,
    roofline_text,
)
from specdecode.model.loading import load_model


def _expected_fp32_bytes(model) -> int:
    """Every projection weight and bias, the norms, one embedding row, a cos and a sin row."""
    cfg = model.config
    hidden, inter, dim = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * dim
    per_layer = qkv * hidden + cfg.num_heads * dim * hidden + 3 * inter * hidden + 2 * hidden
    per_layer += qkv if cfg.qkv_bias else 0
    head = cfg.vocab_size * hidden
    floats = cfg.num_layers * per_layer + hidden + head + 2 * dim + hidden  # + one embedding row
    return 4 * floats


def test_bytes_per_token_counts_every_weight_once(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, dtype="float32")
    cfg = model.config
    nbytes = bytes_per_token(model, context=10)
    assert nbytes["weights"] == _expected_fp32_bytes(model)
    assert nbytes["kv_cache"] == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 10 * 4
    assert nbytes["total"] == nbytes["weights"] + nbytes["kv_cache"]


@pytest.mark.parametrize(("quantization", "most"), [("int8", 0.30), ("int4", 0.25)])
def test_quantized_formats_read_fewer_bytes(
    tiny_model_dir: Path, quantization: str, most: float
) -> None:
    dense = bytes_per_token(load_model(tiny_model_dir, dtype="float32"))["weights"]
    small = bytes_per_token(load_model(tiny_model_dir, "float32", quantization=quantization))
    assert small["weights"] < most * dense


def test_roofline_share_of_floor(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, dtype="float32")
    roof = roofline(model, context=0, bandwidth_gb_s=10.0, measured_ms=2.0)
    floor = bytes_per_token(model)["total"] / 10e9 * 1e3
    assert roof["floor_ms"] == pytest.approx(floor)
    assert roof["share_of_floor"] == pytest.approx(floor / 2.0)
    assert roof["format"] == "float32"
    assert "of the floor speed" in roofline_text(roof)


def test_madds_per_token_count_every_projection_once(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, dtype="float32")
    cfg = model.config
    hidden, inter, dim = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * dim
    per_layer = (qkv + cfg.num_heads * dim) * hidden + 3 * inter * hidden
    assert madds_per_token(model) == cfg.num_layers * per_layer + cfg.vocab_size * hidden


def test_the_pass_table_gives_the_rate_and_the_share_of_the_peak() -> None:
    costs = {
        "context": 8,
        "kernels": "k",
        "target_ms": [10.0, 12.0, 15.0],
        "madds_per_token": 2_000_000_000,
        "int8_peak_gmacs": 1000.0,
    }
    assert achieved_gmacs(costs) == pytest.approx([200.0, 2 * 2 / 0.012, 3 * 2 / 0.015])
    table = pass_table_text(costs)
    assert "int8 peak 1000 G multiply-adds/s" in table
    assert "| 3 | 15.0 | 1.50 | 400 | 40% |" in table
    old = {k: v for k, v in costs.items() if k not in ("madds_per_token", "int8_peak_gmacs")}
    assert achieved_gmacs(old) == [] and "| 3 | 15.0 | 1.50 |" in pass_table_text(old)


@pytest.mark.skipif(not kernels.available(), reason="the CPU kernels are not built")
def test_the_int8_peak_is_measured() -> None:
    assert kernels.int8_peak(iterations=20_000, repeats=2) > 0
    with pytest.raises(ValueError, match="iterations"):
        kernels.int8_peak(iterations=0)
