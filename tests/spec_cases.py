"""Prompts and greedy settings shared by the speculative-decoding tests."""

from __future__ import annotations

from specdecode.types import SamplingParams

# Token-id prompts of different lengths, some repetitive (so prompt lookup finds matches).
PROMPTS = [
    {"prompt_token_ids": [5, 17, 42, 99, 3, 250, 17, 42, 99]},
    {"prompt_token_ids": list(range(10, 40)) + list(range(10, 20))},
    {"prompt_token_ids": [7]},
    {"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]},
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
