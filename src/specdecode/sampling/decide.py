"""The one sampling path from a pass's logits to verdicts: `decide` verifies every row's draft
(greedy rows on token ids, sampled rows by exact rejection sampling) and draws the first token
after a prefill (an empty draft). The engine's verification and its prefill both call it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from specdecode.sampling.argmax import argmax
from specdecode.sampling.probs import SamplingTensors, probs_from_logits
from specdecode.sampling.rejection import verdicts, verify_chain, verify_chain_greedy
from specdecode.sampling.tree import verify_tree, verify_tree_greedy
from specdecode.tree.token_tree import TokenTree
from specdecode.types import Draft, Verdict


@dataclass(frozen=True, slots=True)
class Decision:
    """The verifier's decision over a batch of drafts (`decide`).

    num_accepted: [B] int64, accepted draft tokens per row.
    tokens: [B, K + 1] int64: row b's output is tokens[b, :num_accepted[b] + 1], then PAD.
    paths: per row, a tree's accepted nodes; None when every draft is a chain.
    argmax: [B, K + 1] the target's most likely token after each token of the pass (greedy
        rows' rule reads it); None when no row is greedy and none was asked for.
    """

    num_accepted: Tensor  # [B] int64
    tokens: Tensor  # [B, K + 1] int64
    paths: list[tuple[int, ...]] | None
    argmax: Tensor | None  # [B, K + 1] int64

    @property
    def verdicts(self) -> list[Verdict]:
        return verdicts(self.num_accepted, self.tokens, self.paths)


def pad_tokens(drafts: Seq[Draft], device: torch.device) -> tuple[Tensor, Tensor]:
    """Stack drafts of different lengths: tokens [B, K] (0-padded; K = the longest) and
    lengths [B]."""
    lengths = [int(d.tokens.numel()) for d in drafts]
    tokens = torch.zeros(len(drafts), max(lengths), dtype=torch.long, device=device)  # [B, K]
    for row, draft in enumerate(drafts):
        tokens[row, : lengths[row]] = draft.tokens
    return tokens, torch.tensor(lengths, device=device)


def stack_probs(drafts: Seq[Draft], width: int, vocab: int, device: torch.device) -> Tensor | None:
    """The drafts' q as [B, width, V] (a deterministic draft next to a sampled one gets a
    one-hot q; padding rows are 0), or None when every draft is deterministic."""
    if all(d.probs is None for d in drafts):
        return None
    q = torch.zeros(len(drafts), width, vocab, device=device)  # [B, K, V]
    for row, draft in enumerate(drafts):
        n = int(draft.tokens.numel())
        if draft.probs is None:
            q[row, :n].scatter_(-1, draft.tokens[:, None].to(device), 1.0)
        else:
            q[row, :n] = draft.probs
    return q


def decide(
    logits: Tensor,
    drafts: Seq[Draft],
    tokens: Tensor,
    lengths: Tensor,
    trees: Seq[TokenTree] | None,
    st: SamplingTensors,
    generators: Seq[torch.Generator | None],
    want_argmax: bool = False,
) -> Decision:
    """The one sampling path: verify each row's draft against the target's logits ([B, K + 1,
    V], already masked where a grammar constrains the row); after a prefill, an empty draft
    and [B, 1, V] logits draw the first token. `tokens` [B, K] and `lengths` [B] are the
    drafts as `pad_tokens` stacks them (the caller has them already: it fed them).

    Greedy rows (temperature 0) compare the draft with the target's argmax and emit the
    argmax after it (vLLM's greedy rejection rule): no probabilities, no sums over V. Sampled
    rows run exact rejection sampling (`verify_chain` / `verify_tree`) on p from
    `probs_from_logits`. Each row draws from its own generator only, so splitting the batch
    changes nothing. `trees` (per row, None = all chains) gives a tree pass; `want_argmax`
    keeps the argmax of every row in the decision.
    """
    device = logits.device
    greedy = [b for b, g in enumerate(st.greedy) if g]
    sampled = [b for b, g in enumerate(st.greedy) if not g]
    best = argmax(logits) if greedy or want_argmax else None  # [B, K + 1]
    if not sampled:
        return _decide_greedy(best, tokens, lengths, trees)
    if not greedy:
        return _decide_sampled(logits, drafts, tokens, lengths, trees, st, generators, best)
    g, s = torch.tensor(greedy, device=device), torch.tensor(sampled, device=device)
    greedy_trees = None if trees is None else [trees[b] for b in greedy]
    sampled_trees = None if trees is None else [trees[b] for b in sampled]
    by_greedy = _decide_greedy(best[g], tokens[g], lengths[g], greedy_trees)
    by_sampled = _decide_sampled(
        logits[s],
        [drafts[b] for b in sampled],
        tokens[s],
        lengths[s],
        sampled_trees,
        st.rows(sampled),
        [generators[b] for b in sampled],
        None,
    )
    return _merge((by_greedy, by_sampled), (greedy, sampled), best)


def _decide_greedy(
    best: Tensor, tokens: Tensor, lengths: Tensor, trees: Seq[TokenTree] | None
) -> Decision:
    """`decide` for greedy rows: argmax [B, K + 1], tokens [B, K], lengths [B]."""
    if trees is None:
        num_accepted, out = verify_chain_greedy(best, tokens, lengths)
        return Decision(num_accepted, out, None, best)
    num_accepted, out, paths = verify_tree_greedy(best, tokens, trees)
    return Decision(num_accepted, out, paths, best)


def _decide_sampled(
    logits: Tensor,
    drafts: Seq[Draft],
    tokens: Tensor,
    lengths: Tensor,
    trees: Seq[TokenTree] | None,
    st: SamplingTensors,
    generators: Seq[torch.Generator | None],
    best: Tensor | None,
) -> Decision:
    """`decide` for sampled rows: p [B, K + 1, V] from the logits, q stacked from the drafts."""
    p = probs_from_logits(logits, st)  # [B, K + 1, V]
    q = stack_probs(drafts, tokens.shape[1], logits.shape[-1], logits.device)  # [B, K, V]
    if trees is None:
        num_accepted, out = verify_chain(p, tokens, q, lengths, generators, st.greedy)
        return Decision(num_accepted, out, None, best)
    num_accepted, out, paths = verify_tree(p, tokens, q, trees, generators, st.greedy)
    return Decision(num_accepted, out, paths, best)


def _merge(
    parts: Seq[Decision], rows: tuple[list[int], list[int]], best: Tensor | None
) -> Decision:
    """One decision from the greedy and the sampled rows' (`rows`: their batch rows)."""
    batch = sum(len(r) for r in rows)
    first = parts[0]
    num_accepted = first.num_accepted.new_empty(batch)  # [B]
    tokens = first.tokens.new_empty(batch, first.tokens.shape[1])  # [B, K + 1]
    paths: list[tuple[int, ...]] | None = None if first.paths is None else [()] * batch
    for part, part_rows in zip(parts, rows, strict=True):
        index = torch.tensor(part_rows, device=tokens.device)
        num_accepted[index] = part.num_accepted
        tokens[index] = part.tokens
        if paths is not None and part.paths is not None:
            for row, path in zip(part_rows, part.paths, strict=True):
                paths[row] = path
    return Decision(num_accepted, tokens, paths, best)
