"""Drafts under a grammar: cut them where they break it, extend chains by forced tokens, and
mask the target's logits at every verified position.

Exactness. The target's distribution at each position is its masked one (p = 0 outside the
grammar), the same for plain decoding and for every verified position. A draft token the
grammar refuses has p = 0 and would be rejected for sure, so nothing after it can be accepted:
- a deterministic draft (q one-hot) is cut just before it; its position then samples from p,
  which is what the rule's residual, p without a token of mass 0, is anyway;
- a sampled draft keeps it as its last token, a sure rejection, so the recovered token comes
  from norm(max(p - q, 0)) as the rule says (cutting before it would sample from p instead,
  which is not the residual when q has mass elsewhere).
A token the grammar forces (the only one allowed) has p one-hot on it, so a chain may carry it
as a free draft token (jump-forward): it is accepted with probability 1 and the output is the
same. Trees keep their shape (drafters may read the target at every node): a refused node
is a sure rejection, and nothing below it is reached. They are not extended either.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from specdecode.structured.state import GrammarState, all_allowed, forced_token
from specdecode.tree.token_tree import TokenTree
from specdecode.types import Draft


def constrain_drafts(
    grammars: Sequence[GrammarState | None],
    drafts: Sequence[Draft],
    limits: Sequence[int],
    vocab_size: int,
    keep_shape: bool = False,
) -> tuple[list[Draft], list[Tensor | None]]:
    """Check each draft against its request's grammar (`grammars[b]`, None = unconstrained).

    Returns the drafts (chains cut, or extended by forced tokens up to limits[b] tokens) and,
    per request, its masks [K_b + 1, W] int32 for the verified positions (row i: the tokens
    allowed after the last committed token and the draft's tokens before i; for a tree, row 0
    and then row 1 + node; all allowed below a refused token, where nothing is reached), or
    None for an unconstrained request. With `keep_shape` (a drafter that reads the target's
    argmax after every node of its draft), and for every tree, drafts keep their tokens: a
    refused one is left as a sure rejection. The grammars end where they started.
    """
    out: list[Draft] = []
    masks: list[Tensor | None] = []
    for state, draft, limit in zip(grammars, drafts, limits, strict=True):
        if state is None:
            out.append(draft)
            masks.append(None)
        elif draft.is_tree:
            _append(out, masks, _constrain_tree(state, draft, vocab_size))
        else:
            _append(out, masks, _constrain_chain(state, draft, limit, vocab_size, keep_shape))
    return out, masks


def _append(out: list, masks: list, pair: tuple[Draft, Tensor]) -> None:
    out.append(pair[0])
    masks.append(pair[1])


def _constrain_chain(
    state: GrammarState, draft: Draft, limit: int, vocab_size: int, keep_shape: bool
) -> tuple[Draft, Tensor]:
    """Walk a chain through the grammar; see `constrain_drafts`."""
    tokens = draft.tokens.tolist()
    masks = all_allowed(len(tokens) + 1, vocab_size)  # [K + 1, W]; grows by forced tokens
    taken, kept, whole = 0, len(tokens), True
    for i, token in enumerate(tokens):
        state.fill(masks, i)
        if not state.advance(token):
            kept, whole = (i + 1 if draft.probs is not None else i), False
            break
        taken += 1
        if state.done:  # the end-of-sequence token: nothing after it counts
            kept, whole = i + 1, False
            break
    forced: list[int] = []
    if whole:  # every token taken: the row after the draft, then any forced tokens
        state.fill(masks, kept)
        while not keep_shape and kept + len(forced) < limit and not state.done:
            token = forced_token(masks[kept + len(forced)])
            if token is None or not state.advance(token):
                break
            forced.append(token)
            taken += 1
            if not state.done:
                masks = torch.cat([masks, all_allowed(1, vocab_size)])  # [K + 1 + F, W]
                state.fill(masks, kept + len(forced))
    elif keep_shape:
        kept = len(tokens)
    state.rollback(taken)
    length = kept + len(forced)
    if length == len(tokens):
        return draft, masks[: length + 1]
    new = torch.tensor(tokens[:kept] + forced, dtype=torch.long, device=draft.tokens.device)
    probs = draft.probs
    if probs is not None:
        hot = torch.zeros(len(forced), probs.shape[-1], dtype=probs.dtype, device=probs.device)
        hot[torch.arange(len(forced)), forced] = 1.0  # [F, V]: a forced token's q is one-hot
        probs = torch.cat([probs[:kept], hot])
    tree = None if draft.tree is None else TokenTree.chain(length)
    return Draft(new, probs, tree), masks[: length + 1]


def _constrain_tree(state: GrammarState, draft: Draft, vocab_size: int) -> tuple[Draft, Tensor]:
    """Masks for a tree's nodes; the tree keeps its shape (see `constrain_drafts`)."""
    assert draft.tree is not None
    parents, tokens = draft.tree.parents, draft.tokens.tolist()
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]  # [node + 1] -> children
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    masks = all_allowed(len(parents) + 1, vocab_size)  # [N + 1, W]

    def visit(node: int) -> None:
        if not state.advance(tokens[node]):
            return  # a sure rejection: nothing below it is reached
        if not state.done:
            state.fill(masks, node + 1)
            for child in children[node + 1]:
                visit(child)
        state.rollback(1)

    state.fill(masks, 0)
    for root in children[0]:
        visit(root)
    return draft, masks


def mask_logits(logits: Tensor, masks: Sequence[Tensor | None]) -> None:
    """Set to -inf, in place, every logit its row's grammar does not allow.

    logits: [B, T, V] contiguous, any device and float dtype; masks: per row b, [n_b, W] int32
    on the CPU for its first n_b positions (n_b <= T), or None (row b unconstrained).
    Positions beyond n_b are left alone. The packed bits are unpacked with numpy (bit t % 32 of
    word t // 32 is bit t % 8 of byte (t % 32) // 8 of the little-endian word): with a mostly
    empty mask, as JSON's are, this is ~8x faster than xgrammar 0.2.8's CPU kernel (measured,
    9 rows of 151,936).
    """
    batch, width, vocab = logits.shape
    flat = logits.view(batch * width, vocab)  # [B * T, V]
    for row, mask in enumerate(masks):
        if mask is None:
            continue
        packed = mask.numpy().astype("<i4", copy=False).view(np.uint8)  # [n, 4W], LE words
        bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab]  # [n, V] 0/1
        allowed = torch.from_numpy(bits).to(device=flat.device, dtype=torch.bool)
        start = row * width
        flat[start : start + mask.shape[0]].masked_fill_(~allowed, float("-inf"))
