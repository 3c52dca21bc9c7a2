"""Penalties and logit biases, applied to a verification pass's logits position by position.

A row's pass holds logits for several positions: after its last committed token, and after
each drafted token. Position t's logits are adjusted with the history a one-token step would
have there: the generated tokens, then the drafted tokens on the way to t (a chain's first t,
a tree node's path). The target's decision then reads the same adjusted distribution at every
position as plain decoding would, so speculation stays exact under penalties.

Order (as vLLM's sampler): the logit bias is added, then the repetition penalty (prompt and
history), then the frequency and presence penalties (history only, OpenAI's definition).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft


@dataclass(frozen=True, slots=True)
class History:
    """What one row's adjustments read: its parameters, prompt and generated tokens, and its
    draft (the tokens after the generated ones, position by position)."""

    params: SamplingParams
    prompt_ids: Seq[int]
    output_ids: Seq[int]
    draft: Draft


def drafted_before(draft: Draft, positions: int) -> list[list[int]]:
    """For each of `positions` pass positions, the drafted tokens before it: position 0 none;
    a chain's position t its first t tokens; a tree's position 1 + i node i's path (root
    first). Positions past the draft (padding) repeat the last.

    Example: chain [5, 6] -> [[], [5], [5, 6]] (positions 3.. again [5, 6]).
    """
    tokens = draft.tokens.tolist()
    if draft.tree is None or not draft.is_tree:  # a chain (or a chain-shaped tree: in order)
        prefixes = [tokens[:t] for t in range(len(tokens) + 1)]
    else:
        paths = [draft.tree.path(node) for node in range(len(tokens))]
        prefixes = [[]] + [[tokens[n] for n in path] for path in paths]
    return [prefixes[min(t, len(prefixes) - 1)] for t in range(positions)]


def adjust_logits(logits: Tensor, rows: Seq[History]) -> None:
    """Apply each row's logit bias and penalties to `logits` [B, T, V] in place (rows whose
    parameters adjust nothing are left alone)."""
    vocab = logits.shape[-1]
    for row, history in enumerate(rows):
        if history.params.adjusts_logits:
            _adjust_row(logits[row], history, vocab)


def _adjust_row(logits: Tensor, history: History, vocab: int) -> None:
    """`adjust_logits` for one row's logits [T, V]."""
    params, device = history.params, logits.device
    positions = logits.shape[0]
    if params.logit_bias:
        ids = [token for token, _ in params.logit_bias]  # in the vocabulary: `Engine.check`
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype, device=device)
        logits[:, ids] += bias
    if not (params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1):
        return
    counts = _counts(history, positions, vocab, device)  # [T, V] generated (+ drafted) tokens
    if params.repetition_penalty != 1.0:
        prompt = torch.zeros(vocab, dtype=torch.bool, device=device)  # [V]
        prompt[torch.tensor(list(history.prompt_ids), dtype=torch.long, device=device)] = True
        seen = prompt[None, :] | (counts > 0)  # [T, V]
        rep = params.repetition_penalty
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalized, logits))
    if params.frequency_penalty:
        logits -= params.frequency_penalty * counts.to(logits.dtype)
    if params.presence_penalty:
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)


def _counts(history: History, positions: int, vocab: int, device: torch.device) -> Tensor:
    """[T, V] int64: how often each token occurs in the generated tokens plus, at position t,
    the drafted tokens before t."""
    base = torch.bincount(
        torch.tensor(list(history.output_ids), dtype=torch.long, device=device), minlength=vocab
    )  # [V]
    counts = base[None, :].repeat(positions, 1)  # [T, V]
    rows, cols = [], []
    for t, before in enumerate(drafted_before(history.draft, positions)):
        rows += [t] * len(before)
        cols += before
    if rows:
        ones = torch.ones(len(rows), dtype=torch.long, device=device)
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        counts.index_put_(index, ones, accumulate=True)
    return counts
