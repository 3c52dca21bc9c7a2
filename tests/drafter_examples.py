"""A speculative_config of every registered drafting method for the tiny test models: the
registry's contract tests run each one (`test_speculative.py`, `test_penalties_logprobs.py`)."""

from __future__ import annotations

from pathlib import Path

from conftest import (
    build_tiny_dflash,
    build_tiny_eagle3_head,
    build_tiny_exit_head,
    build_tiny_mtp,
)
from test_cross_tokenizer import build_tiny_cross_draft


def example_config(method: str, model_dir: Path) -> dict[str, object]:
    """A speculative_config of each registered method for the tiny models."""
    examples: dict[str, dict[str, object]] = {
        "ngram": {"num_speculative_tokens": 4, "prompt_lookup_min": 1},
        "suffix": {  # no global trie: a seeded sample's draws depend on the drafts
            "num_speculative_tokens": 4,
            "suffix_decoding_min_token_prob": 0.0,
            "suffix_decoding_max_cached_requests": 0,
        },
        "lookahead": {"window_size": 2, "ngram_size": 3, "guess_set_size": 2},
        "draft_model": {"model": str(model_dir), "num_speculative_tokens": 3},
        "cross_tokenizer": {
            "model": str(build_tiny_cross_draft(model_dir, model_dir / "cross_tokenizer")),
            "num_speculative_tokens": 3,
        },
        "eagle3": {
            "model": str(build_tiny_eagle3_head(model_dir, model_dir / "eagle3")),
            "num_speculative_tokens": 3,
        },
        "eagle3_parallel": {
            "model": str(
                build_tiny_eagle3_head(model_dir, model_dir / "eagle3_parallel", parallel_tokens=3)
            ),
            "num_speculative_tokens": 3,
        },
        "mtp": {
            "model": str(build_tiny_mtp(model_dir, model_dir / "mtp")),
            "num_speculative_tokens": 3,
        },
        "dflash": {
            "model": str(build_tiny_dflash(model_dir, model_dir / "dflash")),
            "num_speculative_tokens": 3,
        },
        **{
            kind: {
                "model": str(build_tiny_exit_head(model_dir, model_dir / kind, kind)),
                "num_speculative_tokens": 3,
            }
            for kind in ("medusa", "layer_skip")
        },
    }
    assert method in examples, f"give the new drafter {method!r} an example config here"
    return {"method": method, **examples[method]}
