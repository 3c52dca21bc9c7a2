"""Shared pieces of the head-training tests: a learnable toy dataset and a small config."""

from __future__ import annotations

from pathlib import Path

from specdecode.corpus.examples import Example
from specdecode.model.tokenizer import Tokenizer
from specdecode.train.config import TrainConfig
from specdecode.train.data import encode_example

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def examples(count: int, offset: int = 0) -> list[Example]:
    """Word lists answered by a fixed cycle of words (a pattern the head can learn)."""
    out = []
    for i in range(offset, offset + count):
        prompt = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(4))
        answer = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(24))
        out.append(Example(f"ex{i}", prompt, answer))
    return out


def chat_prompts(model_dir: Path, items: list[Example]) -> list[dict[str, list[int]]]:
    """The examples' prompts as training encodes them (through the chat template)."""
    tokenizer = Tokenizer.from_folder(model_dir)
    return [
        {"prompt_token_ids": encode_example(tokenizer, Example(e.id, e.prompt, ""), 96)[0]}
        for e in items
    ]


def train_config(model_dir: Path, out: Path, **kw: object) -> TrainConfig:
    """The tests' small run: 64 examples, a 120-token draft vocabulary, an fp32 target, its
    feature store beside `out`."""
    base = dict(
        features=out.with_name(out.name + "-features"),
        model=str(model_dir),
        out=out,
        budget_minutes=None,
        budget_examples=64,
        draft_vocab_size=120,
        max_length=96,
        batch_size=4,
        eval_every=8,
        dtype="float32",
        quantization=None,
        init="random",
        lr=2e-3,
        save_dtype="float32",
        eval_examples=4,
        responses="target",
        max_answer_tokens=40,
    )
    return TrainConfig(**{**base, **kw})
