"""Log-probabilities of the generated tokens (`SamplingParams.logprobs`): read from the
target's raw logits of the pass that verified them, before penalties, temperature and
constraints (vLLM's default, "raw_logprobs"). A token's position in the pass is the one a
one-token step would have scored it at, so the values are the same with speculation as
without (bit for bit where the pass's rows are exact)."""

from __future__ import annotations

import torch
from torch import Tensor

from specdecode.tree.batch import kept_offsets
from specdecode.types import TokenLogprob, Verdict


def raw_logprobs(logits: Tensor) -> Tensor:
    """log-softmax of one row's raw logits [T, V] in float32 -> [T, V]."""
    return torch.log_softmax(logits.float(), dim=-1)


def verdict_positions(verdict: Verdict) -> list[int]:
    """The pass positions whose logits scored each of the verdict's tokens: a chain's first
    num_accepted + 1; on a tree's path, position 0 and then each accepted node's (1 + node).

    Example: tree path (0, 2) -> [0, 1, 3] (the token after node 2 was scored at its position).
    """
    if verdict.path is None:
        return list(range(verdict.num_accepted + 1))
    return kept_offsets([verdict.path])[0]  # the offsets a tree's compaction keeps


def emitted_logprobs(logprobs: Tensor, verdict: Verdict, top: int) -> list[TokenLogprob]:
    """The verdict's tokens with their log-probabilities in `logprobs` [T, V] and the `top`
    most likely tokens at each one's position."""
    positions = torch.tensor(verdict_positions(verdict), device=logprobs.device)
    rows = logprobs[positions]  # [n, V]
    tokens = verdict.tokens.to(logprobs.device)
    chosen = rows.gather(1, tokens[:, None])[:, 0].tolist()  # [n]
    if top > 0:
        values, ids = torch.topk(rows, top, dim=-1)  # [n, top]
        tops = [
            tuple(zip(i, v, strict=True))
            for i, v in zip(ids.tolist(), values.tolist(), strict=True)
        ]
    else:
        tops = [()] * len(chosen)
    return [
        TokenLogprob(token, value, best)
        for token, value, best in zip(tokens.tolist(), chosen, tops, strict=True)
    ]
