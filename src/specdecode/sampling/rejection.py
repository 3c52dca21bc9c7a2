"""Chain verification: exact speculative (rejection) sampling, greedy as its one-hot special case.

Vocabulary (docs/design.md): the target's distribution is `p`, the drafter's is `q`. At draft
position i with draft token x the verifier accepts x with probability min(1, p_i(x) / q_i(x)).
At the first rejection j it emits a **recovered** token drawn from norm(max(p_j - q_j, 0)); after a
fully accepted draft it emits a **bonus** token drawn from p at the position after the draft. The
emitted tokens are then distributed exactly as if sampled from p one by one
(Leviathan et al. 2023, Chen et al. 2023).

A deterministic drafter passes `draft_probs=None`: q is one-hot on the draft token, so x is accepted
with probability p(x) and the residual is p with x removed. Greedy decoding is its special case:
greedy p is one-hot on the argmax, so the same rule accepts while draft == argmax p and otherwise
emits argmax p. Greedy rows (known from their sampling parameters) draw no random numbers at all,
and an all-greedy batch takes that rule on token ids alone (`verify_chain_greedy`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specdecode.types import Verdict

PAD = -1  # fills `tokens` beyond each row's output


def verify_chain(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    num_draft: Tensor,
    generators: Sequence[torch.Generator | None],
    greedy: Sequence[bool] | None = None,
    check: bool = False,
) -> tuple[Tensor, Tensor]:
    """Verify a batch of chain drafts against the target; vectorized over rows and positions.

    Args:
        target_probs: [B, K + 1, V] float32 p at each draft position and at the bonus position;
            row b uses positions 0..num_draft[b].
        draft_tokens: [B, K] int64; row b uses its first num_draft[b] entries, the rest is padding
            (any value, ignored).
        draft_probs: [B, K, V] float32 q of the drafter, or None for a deterministic drafter
            (q one-hot on the draft token).
        num_draft: [B] int64 in 0..K, the draft length of each row.
        generators: B generators, one per row (None = torch's default generator); the same
            object may repeat. Row b draws num_draft[b] + 1 uniforms from generators[b] (rows
            are served in order), unless it is greedy.
        greedy: [B] host bools, True where the row's p is one-hot at every position (temperature
            0, known from its sampling parameters): such a row draws no random numbers, since
            the rule's outcome does not depend on them. None = no row is greedy.
        check: validate shapes, dtypes and ranges first (host syncs; for tests and debugging:
            the engine builds these inputs itself).

    Returns:
        num_accepted: [B] int64 in 0..num_draft[b].
        tokens: [B, K + 1] int64; row b's output is tokens[b, :num_accepted[b] + 1] (the accepted
            draft tokens, then the recovered or bonus token); the rest is PAD (-1).

    Same generator states give the same output; every emitted token has p > 0 at its position.
    """
    batch, k = draft_tokens.shape
    if check:
        check_chain_inputs(target_probs, draft_tokens, draft_probs, num_draft, generators, greedy)
    if greedy is not None and batch and all(greedy):
        return verify_chain_greedy(target_probs.argmax(-1), draft_tokens, num_draft)
    pos = torch.arange(k + 1, device=draft_tokens.device)  # [K + 1]
    valid = pos[:k] < num_draft[:, None]  # [B, K] True at real (non-padding) draft positions
    draft = torch.where(valid, draft_tokens, 0)  # [B, K] padding -> 0, safe to gather
    counts = num_draft.tolist() if greedy is None or not all(greedy) else [0] * batch
    uniforms = draw_uniforms(target_probs, generators, greedy, counts)  # [B, K + 1] float64

    p_x = target_probs[:, :k].gather(-1, draft[..., None]).squeeze(-1)  # [B, K] p_i(x_i)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)  # [B, K] one-hot q puts 1 on the draft token
    else:
        q_x = draft_probs.gather(-1, draft[..., None]).squeeze(-1)  # [B, K] q_i(x_i)
    accept = (uniforms[:, :k] * q_x.double() < p_x.double()) & valid  # [B, K] u*q < p: no 0/0
    num_accepted = _leading_true(accept)  # [B]

    final_dist = _final_distribution(target_probs, draft, draft_probs, num_draft, num_accepted)
    final = sample_inverse_cdf(final_dist, uniforms[:, k])  # [B] recovered or bonus token

    tokens = torch.where(pos[:k] < num_accepted[:, None], draft, PAD)  # [B, K] accepted prefix
    tokens = torch.cat([tokens, tokens.new_full((batch, 1), PAD)], dim=1)  # [B, K + 1]
    tokens.scatter_(1, num_accepted[:, None], final[:, None])  # final token right after them
    return num_accepted, tokens


def verify_chain_greedy(
    target_argmax: Tensor, draft_tokens: Tensor, num_draft: Tensor
) -> tuple[Tensor, Tensor]:
    """`verify_chain` for greedy rows, on token ids alone (vLLM's greedy rejection rule): p is
    one-hot on the argmax, so a draft token is accepted while it equals the target's argmax
    at its position, and the argmax at the first mismatch (or after the whole draft) is
    emitted. No probabilities are built and nothing is drawn.

    target_argmax: [B, K + 1] int64, the argmax of p at each draft position and the bonus one;
    draft_tokens: [B, K] int64 (row b uses its first num_draft[b]); num_draft: [B] int64.
    Returns num_accepted [B] and tokens [B, K + 1] as `verify_chain` does.
    Example: argmax [7, 8, 9, 4], draft [7, 8, 5], 3 drafted -> 2 accepted, tokens [7, 8, 9, PAD].
    """
    batch, k = draft_tokens.shape
    pos = torch.arange(k + 1, device=draft_tokens.device)  # [K + 1]
    valid = pos[:k] < num_draft[:, None]  # [B, K]
    accept = (draft_tokens == target_argmax[:, :k]) & valid  # [B, K]
    num_accepted = _leading_true(accept)  # [B]
    final = target_argmax.gather(1, num_accepted[:, None])  # [B, 1]
    tokens = torch.where(pos[:k] < num_accepted[:, None], draft_tokens, PAD)  # [B, K]
    tokens = torch.cat([tokens, tokens.new_full((batch, 1), PAD)], dim=1)  # [B, K + 1]
    tokens.scatter_(1, num_accepted[:, None], final)
    return num_accepted, tokens


def verdicts(
    num_accepted: Tensor, tokens: Tensor, paths: Sequence[tuple[int, ...]] | None = None
) -> list[Verdict]:
    """Slice verify_chain's (or verify_tree's) batched output into one Verdict per row.

    num_accepted: [B] int64; tokens: [B, K + 1] int64; paths: per row, the accepted tree nodes
    (None for chains). Verdict b holds tokens[b, :n_b + 1].
    """
    counts = num_accepted.tolist()
    paths = [None] * len(counts) if paths is None else paths
    return [
        Verdict(n, row[: n + 1], path) for n, row, path in zip(counts, tokens, paths, strict=True)
    ]


def _leading_true(mask: Tensor) -> Tensor:
    """Count the leading True entries of each row: [B, K] bool -> [B] int64.

    Example: [[1, 1, 0, 1], [0, 1, 1, 1]] -> cumprod [[1, 1, 0, 0], [0, 0, 0, 0]] -> sums [2, 0].
    """
    return mask.long().cumprod(dim=-1).sum(dim=-1)


def draw_uniforms(
    target_probs: Tensor,
    generators: Sequence[torch.Generator | None],
    greedy: Sequence[bool] | None,
    counts: Sequence[int],
) -> Tensor:
    """Draw counts[b] + 1 uniforms in [0, 1) for row b from the row's generator -> [B, W]
    float64 (W = target_probs' K + 1 positions).

    target_probs: [B, W, V]; greedy: [B] or None; counts: per row, its draft tokens (a tree's
    nodes). Column i < counts[b] decides draft position i (node i); column W - 1 holds the
    row's last draw, which samples the recovered or bonus token; padding columns are 0. A row
    draws as many numbers as its own draft needs, so what it draws never depends on the other
    rows (a seeded request gives the same tokens alone and in any batch). Greedy rows get zeros
    and leave their generator untouched: with one-hot p, `u * q < p` and sampling p do not
    depend on u.
    """
    batch, width, _ = target_probs.shape
    uniforms = torch.zeros(batch, width, dtype=torch.float64, device=target_probs.device)
    kwargs = {"dtype": torch.float64, "device": target_probs.device}
    for b in range(batch):
        if greedy is not None and greedy[b]:
            continue
        drawn = torch.rand(counts[b] + 1, generator=generators[b], **kwargs)
        uniforms[b, : counts[b]] = drawn[:-1]
        uniforms[b, -1] = drawn[-1]
    return uniforms


def _final_distribution(
    target_probs: Tensor,
    draft: Tensor,
    draft_probs: Tensor | None,
    num_draft: Tensor,
    num_accepted: Tensor,
) -> Tensor:
    """The distribution of each row's last output token -> [B, V] float32 (not normalized).

    target_probs: [B, K + 1, V]; draft: [B, K] (padding replaced by 0); draft_probs: [B, K, V] or
    None; num_draft, num_accepted: [B]. Row b stops at position j = num_accepted[b]: if
    j < num_draft[b] the draft was rejected there and the token is recovered from
    max(p_j - q_j, 0); otherwise it is a bonus token from p_j. A residual that is all zero
    (only possible where p_j == q_j, where rejection has probability 0) falls back to p_j.
    """
    batch, k = draft.shape
    rows = torch.arange(batch, device=draft.device)  # [B]
    p_final = target_probs[rows, num_accepted]  # [B, V] p at position j
    if k == 0:
        return p_final
    j = num_accepted.clamp(max=k - 1)  # [B] in range even after a full accept (unused then)
    if draft_probs is None:
        q_final = torch.zeros_like(p_final).scatter_(1, draft[rows, j][:, None], 1.0)  # [B, V]
    else:
        q_final = draft_probs[rows, j]  # [B, V]
    residual = (p_final - q_final).clamp_min(0.0)  # [B, V] > 0 only where p > q, so p > 0
    use_residual = (num_accepted < num_draft) & (residual.sum(dim=-1) > 0)  # [B]
    return torch.where(use_residual[:, None], residual, p_final)


def sample_inverse_cdf(dist: Tensor, u: Tensor) -> Tensor:
    """Sample one token per row of an unnormalized distribution by inverting its CDF.

    dist: [B, V] float32 >= 0 with a positive sum; u: [B] float64 in [0, 1) -> [B] int64.
    Picks the first index whose cumulative mass exceeds u * total, so a zero-mass token is never
    picked, and a one-hot row gives its hot index for every u (no randomness needed).
    Example: dist [0, .5, 0, .5], u .6 -> cdf [0, .5, .5, 1], .6 * 1 -> index 3.
    """
    cdf = dist.double().cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1]  # [B]
    bad = ~(total > 0) | ~torch.isfinite(total)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(
            f"row {row}: the target probabilities at its final position must be finite, "
            f"non-negative and sum to > 0, got sum {float(total[row])}"
        )
    idx = torch.searchsorted(cdf, (u * total)[:, None], right=True).squeeze(1)  # [B] in 0..V
    vocab = dist.shape[-1]
    last_positive = vocab - 1 - (dist.flip(-1) > 0).int().argmax(dim=-1)  # [B]
    return torch.minimum(idx, last_positive)  # guards u * total rounding up to total (idx == V)


def check_chain_inputs(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    num_draft: Tensor,
    generators: Sequence[torch.Generator | None],
    greedy: Sequence[bool] | None = None,
) -> None:
    """Raise ValueError with a readable message if verify_chain's inputs do not fit (shapes,
    dtypes, ranges, one-hot p on greedy rows; the arguments as verify_chain's)."""
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.long:
        raise ValueError(
            f"draft_tokens must be [B, K] int64, "
            f"got {tuple(draft_tokens.shape)} {draft_tokens.dtype}"
        )
    batch, k = draft_tokens.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (batch, k + 1):
        raise ValueError(
            f"target_probs must be [B, K + 1, V] = [{batch}, {k + 1}, V], "
            f"got {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[-1]
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k, vocab):
        raise ValueError(
            f"draft_probs must be [B, K, V] = [{batch}, {k}, {vocab}] or None, "
            f"got {tuple(draft_probs.shape)}"
        )
    if tuple(num_draft.shape) != (batch,) or num_draft.dtype != torch.long:
        raise ValueError(f"num_draft must be [B] = [{batch}] int64, got {tuple(num_draft.shape)}")
    if batch and not bool(((num_draft >= 0) & (num_draft <= k)).all()):
        raise ValueError(f"num_draft must be in 0..K = 0..{k}, got {num_draft.tolist()}")
    if len(generators) != batch:
        raise ValueError(f"need one generator (or None) per row: {batch}, got {len(generators)}")
    if greedy is not None and len(greedy) != batch:
        raise ValueError(f"greedy needs one entry per row: {batch}, got {len(greedy)}")
    for row in [] if greedy is None else [b for b in range(batch) if greedy[b]]:
        used = target_probs[row, : int(num_draft[row]) + 1]  # [n + 1, V]
        if not bool(((used > 0).sum(-1) == 1).all()):
            raise ValueError(f"row {row} is marked greedy but its target_probs are not one-hot")
    valid = torch.arange(k, device=num_draft.device) < num_draft[:, None]  # [B, K]
    used = draft_tokens[valid]
    if used.numel() and not bool(((used >= 0) & (used < vocab)).all()):
        bad = used[(used < 0) | (used >= vocab)]
        raise ValueError(
            f"draft tokens must be in 0..V - 1 = 0..{vocab - 1} (padding beyond num_draft is "
            f"ignored), got {bad[:8].tolist()}"
        )
