"""One speculative step for a batch: draft -> verify -> commit.

Cache invariant: a request's cache row holds all its committed tokens but the last one, which
is fed as the first input of the next step. A step of chains feeds [last, d_1 .. d_K] at
positions L .. L + K (L = cached length) in one DECODE pass (each token attends as a one-token
step would); the logits at those positions give p for d_1 .. d_K and for the bonus token. After
the verdict the row is rolled back to L + 1 + accepted. A step with a tree draft in the batch
feeds every row's [last, nodes...] in one TREE pass (`specdecode.tree.batch`; chains ride along
as chain-shaped trees), verifies with `verify_tree` and keeps the accepted path with
`KVCache.compact`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from specdecode.cache.kv_cache import KVCache
from specdecode.drafters.base import MAX_SPECULATIVE_TOKENS, Drafter, check_drafts
from specdecode.engine.draft_length import DraftLength
from specdecode.engine.output import OutputProcessor
from specdecode.engine.request import Request
from specdecode.model.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.model.transformer import Transformer
from specdecode.sampling.probs import SamplingTensors, probs_from_logits
from specdecode.sampling.rejection import verdicts, verify_chain
from specdecode.sampling.tree import verify_tree
from specdecode.structured.drafts import constrain_drafts, mask_logits
from specdecode.tree.batch import kept_offsets, tree_metadata
from specdecode.tree.token_tree import TokenTree
from specdecode.types import Draft, StepEvent, TargetFeatures, Verdict


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


def keep_features(
    reqs: Seq[Request], starts: Seq[int], kept: Seq[int | Seq[int]], hidden: Tensor | None
) -> None:
    """Leave each request the hidden states its drafter asked for, for tokens from index
    starts[b]: of row b of `hidden` ([B, T, F], None = none asked), the first kept[b]
    positions, or the positions kept[b] lists (a tree's kept path)."""
    if hidden is None:
        return
    for row, (req, start, keep) in enumerate(zip(reqs, starts, kept, strict=True)):
        states = hidden[row, :keep] if isinstance(keep, int) else hidden[row, list(keep)]
        req.features = TargetFeatures(start, states)


def verify(
    model: Transformer,
    cache: KVCache,
    reqs: Seq[Request],
    drafts: Seq[Draft],
    st: SamplingTensors,
    hidden_layers: tuple[int, ...] | None = None,
    keep_argmax: bool = False,
    masks: Seq[Tensor | None] | None = None,
) -> list[Verdict]:
    """Run [last token, draft...] of every row through the target and verify the drafts
    (chains, or trees when any draft is one); with `hidden_layers`, keep the hidden states of
    the tokens kept (see `keep_features`); with `keep_argmax`, each request's
    `target_argmax`; with `masks` (`constrain_drafts`), p is the grammar's masked one."""
    device = model.device
    draft_tokens, q, num_draft = pad_drafts(drafts, model.config.vocab_size, device)
    last = torch.tensor([r.output_ids[-1] for r in reqs], device=device)  # [B]
    tokens = torch.cat([last[:, None], draft_tokens], dim=1)  # [B, K + 1]
    starts, limit = cache.lengths, model.config.max_position_embeddings
    trees = None
    if any(d.is_tree for d in drafts):
        trees = [d.tree or TokenTree.chain(int(d.tokens.numel())) for d in drafts]
        meta = tree_metadata(starts, trees, tokens.shape[1], device, limit)
    else:
        sizes = [1 + int(d.tokens.numel()) for d in drafts]
        meta = AttentionMetadata.contiguous(
            AttentionMode.DECODE, starts, sizes, device, tokens.shape[1], limit
        )
    logits, hidden = model(tokens, meta, cache, hidden_layers=hidden_layers)  # [B, K + 1, V]
    if masks is not None:
        mask_logits(logits, masks)
    p = probs_from_logits(logits, st)  # [B, K + 1, V]
    if keep_argmax:
        best = p.argmax(-1).tolist()  # [B][K + 1]
        for req, row, n in zip(reqs, best, num_draft.tolist(), strict=True):
            req.target_argmax = row[: n + 1]
    generators = [r.generator for r in reqs]
    hidden = hidden if hidden_layers else None
    if trees is None:
        num_accepted, out = verify_chain(p, draft_tokens, q, num_draft, generators, st.greedy)
        accepted = num_accepted.tolist()
        cache.truncate([s + 1 + a for s, a in zip(meta.starts, accepted, strict=True)])
        keep_features(reqs, meta.starts, [1 + a for a in accepted], hidden)
        return verdicts(num_accepted, out)
    num_accepted, out, paths = verify_tree(p, draft_tokens, q, trees, generators, st.greedy)
    kept = kept_offsets(paths)
    cache.compact(meta.starts, kept)
    keep_features(reqs, meta.starts, kept, hidden)
    return verdicts(num_accepted, out, paths)


def final_kind(draft: Draft, verdict: Verdict) -> str:
    """What the target's own token of a verdict is (`StepEvent.final`): "sampled" after an
    empty draft, "bonus" when nothing drafted below the last accepted token was rejected,
    else "correction"."""
    num_draft = int(draft.tokens.numel())
    if num_draft == 0:
        return "sampled"
    if verdict.path is None or draft.tree is None:  # a chain, or a chain-shaped tree
        return "bonus" if verdict.num_accepted == num_draft else "correction"
    last = verdict.path[-1] if verdict.path else -1
    return "correction" if last in draft.tree.parents else "bonus"


def step_event(
    req: Request,
    draft: Draft,
    verdict: Verdict,
    first: int,
    pieces: list[str],
    seconds: tuple[float, float],
    batch_size: int,
) -> StepEvent:
    """The `StepEvent` of `req`'s step that committed its tokens from index `first` (with
    their detokenized `pieces`), after (drafting, verification) `seconds`."""
    tokens = tuple(req.output_ids[first:])
    tree = draft.tree if draft.is_tree else None
    return StepEvent(
        index=len(req.steps),
        drafted=tuple(draft.tokens.tolist()),
        parents=None if tree is None else tree.parents,
        num_accepted=verdict.num_accepted,
        path=verdict.path if tree is not None else None,
        final=final_kind(draft, verdict),
        tokens=tokens,
        pieces=tuple(pieces[: len(tokens)]),
        draft_s=seconds[0],
        verify_s=seconds[1],
        batch_size=batch_size,
        elapsed_s=time.perf_counter() - req.t_start,
    )


def commit(
    reqs: Seq[Request],
    drafts: Seq[Draft],
    verdicts: Seq[Verdict],
    drafter: Drafter,
    outputs: OutputProcessor,
    draft_s: float = 0.0,
    verify_s: float = 0.0,
) -> list[str]:
    """Append each verdict to its request, count it (with `draft_s` seconds of drafting
    each), record its `StepEvent` when the request asked (with the batch's `verify_s`), sync
    the drafter; returns new texts."""
    texts = []
    for req, draft, verdict in zip(reqs, drafts, verdicts, strict=True):
        before = len(req.output_ids)
        pieces: list[str] | None = [] if req.params.step_events else None
        taken = req.append(verdict.tokens.tolist())
        if req.grammar is not None:
            req.grammar.commit(taken)
        texts.append(outputs.process(req, taken, pieces))
        depth = draft.tree.depth if draft.tree is not None else None
        emitted = len(req.output_ids) - before
        req.spec.record(int(draft.tokens.numel()), verdict.num_accepted, emitted, depth, draft_s)
        if pieces is not None:
            seconds = (draft_s, verify_s)
            req.steps.append(step_event(req, draft, verdict, before, pieces, seconds, len(reqs)))
        drafter.commit(req, verdict)
    return texts


def draft_cap(req: Request) -> int:
    """The most draft tokens `req` takes per step: its own `num_speculative_tokens`, else
    MAX_SPECULATIVE_TOKENS."""
    asked = req.params.num_speculative_tokens
    return MAX_SPECULATIVE_TOKENS if asked is None else asked


def speculative_step(
    model: Transformer,
    cache: KVCache,
    reqs: Seq[Request],
    drafter: Drafter,
    st: SamplingTensors,
    outputs: OutputProcessor,
    draft_length: DraftLength,
) -> list[str]:
    """Draft (at most `draft_length`'s limit per request), check the drafts of constrained
    requests against their grammars, verify and commit once for every request; returns each
    one's new text."""
    ids = [r.request_id for r in reqs]
    chosen = draft_length.limits(ids)
    limits = [
        min(k, draft_cap(r), r.max_new - len(r.output_ids) - 1)
        for r, k in zip(reqs, chosen, strict=True)
    ]
    start = time.perf_counter()
    drafts = drafter.propose(reqs, limits)
    drafted = time.perf_counter()
    check_drafts(drafts, limits, model.config.vocab_size)
    masks = None
    keep_argmax = getattr(drafter, "wants_target_argmax", False)
    if any(r.grammar is not None for r in reqs):
        vocab = model.config.vocab_size
        drafts, masks = constrain_drafts(reqs, drafts, limits, vocab, keep_shape=keep_argmax)
    layers = drafter.hidden_layers or None
    verdicts = verify(model, cache, reqs, drafts, st, layers, keep_argmax, masks)
    verify_s = time.perf_counter() - drafted
    per_token_s = drafted - start - getattr(drafter, "setup_s", 0.0)  # prompts' prefills aside
    draft_length.observe(ids, drafts, verdicts, per_token_s, verify_s)
    draft_s = (drafted - start) / len(reqs)
    return commit(reqs, drafts, verdicts, drafter, outputs, draft_s, verify_s)
