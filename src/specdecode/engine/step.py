"""One speculative step for a batch: draft -> verify -> commit.

Cache invariant: a sequence's cache row holds all its committed tokens but the last one, which
is fed as the first input of the next step. A step feeds [last, d_1 .. d_K] at positions
L .. L + K (L = cached length); the logits at those positions give p for d_1 .. d_K and for the
bonus token. After the verdict the row is rolled back to L + 1 + accepted.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from specdecode.cache.kv_cache import KVCache
from specdecode.drafters.base import Drafter
from specdecode.engine.sequence import Sequence
from specdecode.model.transformer import Transformer
from specdecode.sampling.probs import SamplingTensors, probs_from_logits
from specdecode.sampling.rejection import verdicts, verify_chain
from specdecode.spec_config import MAX_SPECULATIVE_TOKENS
from specdecode.types import Draft, Verdict


def pad_drafts(
    drafts: Seq[Draft], vocab: int, device: torch.device
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Stack drafts of different lengths.

    Returns tokens [B, K] (0-padded), q [B, K, V] (None when every draft is deterministic) and
    lengths [B]; K = the longest draft. A deterministic draft next to a sampled one gets a
    one-hot q.
    """
    lengths = [int(d.tokens.numel()) for d in drafts]
    width = max(lengths)
    tokens = torch.zeros(len(drafts), width, dtype=torch.long, device=device)  # [B, K]
    for row, draft in enumerate(drafts):
        tokens[row, : lengths[row]] = draft.tokens
    q = None
    if any(d.probs is not None for d in drafts):
        q = torch.zeros(len(drafts), width, vocab, device=device)  # [B, K, V]
        for row, draft in enumerate(drafts):
            if draft.probs is None:
                q[row, : lengths[row]].scatter_(-1, draft.tokens[:, None].to(device), 1.0)
            else:
                q[row, : lengths[row]] = draft.probs
    return tokens, q, torch.tensor(lengths, device=device)


def verify(
    model: Transformer,
    cache: KVCache,
    seqs: Seq[Sequence],
    drafts: Seq[Draft],
    st: SamplingTensors,
) -> list[Verdict]:
    """Run [last token, draft...] of every row through the target and verify the drafts."""
    device = model.device
    draft_tokens, q, num_draft = pad_drafts(drafts, model.config.vocab_size, device)
    last = torch.tensor([s.output_ids[-1] for s in seqs], device=device)  # [B]
    tokens = torch.cat([last[:, None], draft_tokens], dim=1)  # [B, K + 1]
    start = list(cache.lengths)
    offsets = torch.arange(tokens.shape[1], device=device)
    positions = torch.tensor(start, device=device)[:, None] + offsets  # [B, K + 1]
    # Padding beyond a row's own draft may run past the context end; it is never kept.
    positions = positions.clamp(max=model.config.max_position_embeddings - 1)
    logits, _ = model(tokens, positions, cache)  # [B, K + 1, V]
    p = probs_from_logits(logits, st)  # [B, K + 1, V]
    num_accepted, out = verify_chain(p, draft_tokens, q, num_draft, [s.generator for s in seqs])
    cache.truncate([n + 1 + a for n, a in zip(start, num_accepted.tolist(), strict=True)])
    return verdicts(num_accepted, out)


def commit(
    seqs: Seq[Sequence], drafts: Seq[Draft], verdicts: Seq[Verdict], drafter: Drafter
) -> list[str]:
    """Append each verdict to its sequence, count it, sync the drafter; returns new texts."""
    texts = []
    for seq, draft, verdict in zip(seqs, drafts, verdicts, strict=True):
        before = len(seq.output_ids)
        texts.append(seq.append(verdict.tokens.tolist()))
        emitted = len(seq.output_ids) - before
        seq.spec.record(int(draft.tokens.numel()), verdict.num_accepted, emitted)
        drafter.commit(seq, verdict)
    return texts


def speculative_step(
    model: Transformer,
    cache: KVCache,
    seqs: Seq[Sequence],
    drafter: Drafter,
    st: SamplingTensors,
) -> list[str]:
    """Draft, verify and commit once for every sequence; returns each one's new text."""
    limits = [min(MAX_SPECULATIVE_TOKENS, s.max_new - len(s.output_ids) - 1) for s in seqs]
    drafts = drafter.propose(seqs, limits)
    return commit(seqs, drafts, verify(model, cache, seqs, drafts, st), drafter)
