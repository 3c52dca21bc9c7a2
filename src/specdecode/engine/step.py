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
from dataclasses import dataclass

import torch
from torch import Tensor

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.cache.kv_cache import KVCache
from specdecode.drafters.base import MAX_SPECULATIVE_TOKENS, Drafter, DrafterNeeds, check_drafts
from specdecode.drafters.plain import EMPTY_DRAFT
from specdecode.engine.draft_length import DraftLength
from specdecode.engine.output import OutputProcessor
from specdecode.engine.request import Request
from specdecode.model.transformer import Transformer
from specdecode.sampling.adjust import History, adjust_logits
from specdecode.sampling.decide import Decision, decide, pad_tokens
from specdecode.sampling.logprobs import emitted_logprobs, raw_logprobs
from specdecode.sampling.probs import SamplingTensors
from specdecode.structured.drafts import constrain_drafts, mask_logits
from specdecode.tree.batch import kept_offsets, tree_metadata
from specdecode.tree.token_tree import TokenTree
from specdecode.types import (
    NO_TARGET_OUTPUTS,
    Draft,
    DraftBudget,
    StepEvent,
    TargetFeatures,
    TargetOutputs,
    TokenLogprob,
    Verdict,
)


@dataclass(frozen=True, slots=True)
class VerifyOutput:
    """What verification hands the commit phase: per row, its verdict, what the target's
    pass hands the drafter (`TargetOutputs`, as the drafter's needs asked) and, for a request
    that asked for them, its tokens' log-probabilities (else None)."""

    verdicts: list[Verdict]
    targets: list[TargetOutputs]
    logprobs: list[list[TokenLogprob] | None]


def score(
    logits: Tensor, reqs: Seq[Request], drafts: Seq[Draft], masks: Seq[Tensor | None] | None
) -> list[Tensor | None]:
    """Ready a pass's logits [B, T, V] for the decision, in place: each row's logit bias and
    penalties (`adjust_logits`, position by position), then the grammars' `masks`. Returns
    the raw log-probabilities [T, V] of the rows that asked for logprobs, taken before."""
    raw = [
        raw_logprobs(logits[row]) if req.params.logprobs is not None else None
        for row, req in enumerate(reqs)
    ]
    if any(req.params.adjusts_logits for req in reqs):
        rows = zip(reqs, drafts, strict=True)
        adjust_logits(logits, [History(r.params, r.prompt_ids, r.output_ids, d) for r, d in rows])
    if masks is not None:
        mask_logits(logits, masks)
    return raw


def token_logprobs(
    raw: Seq[Tensor | None], reqs: Seq[Request], verdicts: Seq[Verdict]
) -> list[list[TokenLogprob] | None]:
    """Per row, its verdict's tokens with their log-probabilities from `raw` (`score`)."""
    return [
        None if lp is None else emitted_logprobs(lp, verdict, req.params.logprobs or 0)
        for lp, req, verdict in zip(raw, reqs, verdicts, strict=True)
    ]


def target_outputs(
    needs: DrafterNeeds,
    starts: Seq[int],
    kept: Seq[int | Seq[int]],
    hidden: Tensor | None,
    decision: Decision,
    lengths: Seq[int],
) -> list[TargetOutputs]:
    """Per row, what the pass hands the drafter: the hidden states it asked for (of row b of
    `hidden` [B, T, F], the first kept[b] positions or the positions kept[b] lists, a tree's
    kept path; they belong to the tokens from index starts[b]) and the target's argmax after
    the row's lengths[b] draft tokens (and the last committed token)."""
    if not needs.hidden_layers and not needs.target_argmax:
        return [NO_TARGET_OUTPUTS] * len(starts)
    best = decision.argmax.tolist() if needs.target_argmax else None  # [B][K + 1]
    out = []
    for row, (start, keep, n) in enumerate(zip(starts, kept, lengths, strict=True)):
        features = None
        if needs.hidden_layers and hidden is not None:
            states = hidden[row, :keep] if isinstance(keep, int) else hidden[row, list(keep)]
            features = TargetFeatures(start, states)
        argmax = None if best is None else tuple(best[row][: n + 1])
        out.append(TargetOutputs(features, argmax))
    return out


@dataclass(frozen=True, slots=True)
class Fed:
    """The rows a target pass verifies: their requests and drafts (`draft_tokens` [B, K] and
    `num_draft` [B] as `pad_tokens` stacks them; `trees` per row when any draft is one, else
    None), where each row's fed tokens start in its cache row (`starts`) and how many of
    them come before its draft (`lead`: 1, the last committed token, in a decoding step; the
    chunk of prompt tokens in a prefill)."""

    reqs: Seq[Request]
    drafts: Seq[Draft]
    draft_tokens: Tensor
    num_draft: Tensor
    trees: list[TokenTree] | None
    starts: Seq[int]
    lead: Seq[int]

    @staticmethod
    def prompts(
        reqs: Seq[Request], starts: Seq[int], chunks: Seq[int], device: torch.device
    ) -> Fed:
        """Prefill rows: request b fed `chunks[b]` prompt tokens from index `starts[b]` and
        drafts nothing (the pass draws its first token)."""
        drafts = [EMPTY_DRAFT] * len(reqs)
        none, zero = pad_tokens(drafts, device)  # [B, 0], [B]
        return Fed(reqs, drafts, none, zero, None, starts, chunks)


def settle(
    fed: Fed,
    logits: Tensor,
    hidden: Tensor | None,
    st: SamplingTensors,
    needs: DrafterNeeds,
    masks: Seq[Tensor | None] | None,
) -> tuple[VerifyOutput, list[int] | list[list[int]]]:
    """After the target's pass over `fed`: ready its logits [B, K + 1, V] (`score`: bias,
    penalties, the grammars' `masks`), decide each row (`decide`), and hand back the
    `VerifyOutput` (verdicts, what the drafter's `needs` asked of `hidden` [B, T, F], the
    log-probabilities) with each row's kept fed positions: a count (`lead` + accepted) for
    chains, the offsets of the accepted path for trees. A prefill is a settle of empty
    drafts (`Fed.prompts`), so the first token and every later one take the same path."""
    raw = score(logits, fed.reqs, fed.drafts, masks)
    generators = [r.generator for r in fed.reqs]
    decision = decide(
        logits,
        fed.drafts,
        fed.draft_tokens,
        fed.num_draft,
        fed.trees,
        st,
        generators,
        needs.target_argmax,
    )
    kept: list[int] | list[list[int]]
    if decision.paths is None:
        accepted = decision.num_accepted.tolist()
        kept = [n + a for n, a in zip(fed.lead, accepted, strict=True)]
    else:
        kept = kept_offsets(decision.paths)
    lengths = [int(d.tokens.numel()) for d in fed.drafts]
    targets = target_outputs(needs, fed.starts, kept, hidden, decision, lengths)
    verdicts = decision.verdicts
    return VerifyOutput(verdicts, targets, token_logprobs(raw, fed.reqs, verdicts)), kept


def verify(
    model: Transformer,
    cache: KVCache,
    reqs: Seq[Request],
    drafts: Seq[Draft],
    st: SamplingTensors,
    needs: DrafterNeeds,
    masks: Seq[Tensor | None] | None = None,
) -> VerifyOutput:
    """Run [last token, draft...] of every row through the target, `settle` the drafts
    (chains, or trees when any draft is one) and keep each row's accepted tokens in its
    cache row; with `masks` (`constrain_drafts`), p is the grammar's masked one."""
    device = model.device
    draft_tokens, num_draft = pad_tokens(drafts, device)  # [B, K], [B]
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
    layers = needs.hidden_layers or None
    logits, hidden = model(tokens, meta, cache, hidden_layers=layers)  # [B, K + 1, V]
    fed = Fed(reqs, drafts, draft_tokens, num_draft, trees, meta.starts, [1] * len(reqs))
    verified, kept = settle(fed, logits, hidden, st, needs, masks)
    if trees is None:
        cache.truncate([s + k for s, k in zip(meta.starts, kept, strict=True)])
    else:
        cache.compact(meta.starts, kept)
    return verified


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
    verified: VerifyOutput,
    drafter: Drafter,
    outputs: OutputProcessor,
    draft_s: float = 0.0,
    verify_s: float = 0.0,
) -> list[str]:
    """Append each verdict to its request, count it (with `draft_s` seconds of drafting
    each), record its `StepEvent` when the request asked (with the batch's `verify_s`), hand
    the drafter the verdict and its target outputs; returns new texts."""
    texts = []
    rows = zip(reqs, drafts, verified.verdicts, verified.targets, verified.logprobs, strict=True)
    for req, draft, verdict, target, logprobs in rows:
        before = len(req.output_ids)
        pieces: list[str] | None = [] if req.params.step_events else None
        taken = req.append(verdict.tokens.tolist())
        if req.logprobs is not None and logprobs is not None:
            req.logprobs.extend(logprobs[: len(taken)])
        if req.grammar is not None:
            req.grammar.commit(taken)
        texts.append(outputs.process(req, taken, pieces))
        depth = draft.tree.depth if draft.tree is not None else None
        emitted = len(req.output_ids) - before
        req.spec.record(int(draft.tokens.numel()), verdict.num_accepted, emitted, depth, draft_s)
        if pieces is not None:
            seconds = (draft_s, verify_s)
            req.steps.append(step_event(req, draft, verdict, before, pieces, seconds, len(reqs)))
        drafter.commit(req, verdict, target)
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
    remaining = [r.max_new - len(r.output_ids) for r in reqs]  # new tokens each may still take
    # seeded sampling keeps its draws whatever the measured costs (`DraftLength.limits`)
    pinned = [r.params.seed is not None and not r.params.greedy for r in reqs]
    caps = [min(draft_cap(r), left - 1) for r, left in zip(reqs, remaining, strict=True)]
    catch_up = None  # one-time work before each one's draft, where the policy prices it
    if draft_length.prices_catch_up:  # (none where no draft can come this step)
        rows = zip(reqs, caps, strict=True)
        catch_up = [drafter.catch_up(r) if cap > 0 else 0 for r, cap in rows]
    chosen = draft_length.limits(ids, catch_up, remaining, pinned)
    limits = [min(k, cap) for k, cap in zip(chosen, caps, strict=True)]
    bounds = draft_length.chain_bounds(ids, limits, pinned)
    budgets = [DraftBudget(k, b) for k, b in zip(limits, bounds, strict=True)]
    start = time.perf_counter()
    drafts = drafter.propose(reqs, budgets)
    drafted = time.perf_counter()
    check_drafts(drafts, limits, model.config.vocab_size)
    masks = None
    needs = drafter.needs
    if any(r.grammar is not None for r in reqs):
        grammars = [r.grammar for r in reqs]
        vocab, keep = model.config.vocab_size, needs.target_argmax
        drafts, masks = constrain_drafts(grammars, drafts, limits, vocab, keep_shape=keep)
    verified = verify(model, cache, reqs, drafts, st, needs, masks)
    verify_s = time.perf_counter() - drafted
    per_token_s = drafted - start - drafter.setup_s  # prompts' prefills aside
    draft_length.observe(ids, drafts, verified.verdicts, per_token_s, verify_s, drafter.setup_s)
    draft_s = (drafted - start) / len(reqs)
    return commit(reqs, drafts, verified, drafter, outputs, draft_s, verify_s)
