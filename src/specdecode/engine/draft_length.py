"""Adaptive draft length: how many tokens each request may draft this step.

`num_speculative_tokens` (K) is the most a drafter may draft; a `DraftLength` policy picks, per
request and per step, a limit k in 0..K (0 = decode one token without a draft):

- "fixed": always K (the drafter may still draft fewer).
- "heuristic": Hugging Face's dynamic schedule for assistant models: start at K; after a step
  whose draft was wholly accepted, k += 2 (at most K), else k -= 1 (at least 1).
- "cost" (ours): the k with the most expected tokens per second, one k for the whole batch
  (a verification pass pads every row to the longest draft, so one request's long draft
  widens everyone's pass). With request i's acceptance rate a_i (each draft token accepted
  with probability a_i) and the share v_i of steps in which it drafts at all when it may (a
  lookup drafter finds no match in some), a step of k draft tokens per row emits
  sum_i 1 + v_i (E(a_i, k) - 1) tokens, E(a, k) = (1 - a^(k+1)) / (1 - a), and costs
  sum_i v_i * k * d + t(B, k + 1) seconds, where d = measured drafting seconds per draft
  token, t(B, n) = measured seconds of a verification pass of B rows (the batch) of n tokens
  each. k = 0 costs t(B, 1) for B tokens, so the batch drafts only where that pays; after
  `PROBE_EVERY` x B steps without a draft, the whole batch drafts once more (acceptance may
  have changed; one request probing alone would widen every row's pass anyway, and a probe
  costs every row a draft), unless not even drafts that are always accepted would pay at
  this batch size. A lookup drafter's trie (ngram, suffix) is priced as a chain of its node
  count (its acceptance is counted along its depth: an approximation).

Trees a drafter grows from its own distributions (a draft model's or head's dynamic tree,
`tree_width` > 1: `trees=True`) are priced whole: their limit is 0 or K (the K-node tree, as
configured; a tree given fewer nodes is another, worse tree whose acceptance the rule has not
measured), drafting D levels, D the mean depth of the trees drafted so far. With a_i now the
share of tree levels accepted (each level up to the first rejection a success, as a chain's
positions), a tree step emits sum_i 1 + v_i (E(a_i, D) - 1) tokens and costs
sum_i v_i * D * d + t(B, K + 1) seconds, d = measured drafting seconds per tree level. E.g. a
draft model's K = 4 node tree of w = 2, D = 2, with a = 0.6, d = 9 ms, t(1, 1) = 28 ms and
t(1, 5) = 31 ms gives 1.96 / 49 = 40 tok/s against plain decoding's 35.7: it drafts.

A drafter with one-time work per sequence (a draft model prefilling a prompt, or catching up
on the tokens committed while it did not draft: `Drafter.setup_s`) makes a request pay for its
catch-up before its first draft. The cost rule prices it: a request's catch-up tokens are what
its drafter says it would read alone before drafting (`Drafter.catch_up`: a draft model's new
prompt, or a backlog of more than K + 1 tokens, fewer being fed with the draft's first pass
and priced as drafting; with a prompt window at most the window and what followed it); their
seconds per token are learned from the steps that paid them (s).
Such a request drafts only if the time its drafts would save over the tokens it may still
generate, R * B * (1 / rate(0) - 1 / rate(k)) with the batch's k, is at least the catch-up's
s * n seconds; otherwise its limit is 0 (a short answer after a long prompt is not worth the
draft model's prefill). Before any catch-up was measured, s = 0: the first request pays it.

Within the step's limit, the cost rule also tells a drafter that knows how sure it is (a draft
model) where a chain stops paying (`chain_bounds`, handed over in its `DraftBudget`): a
chain of j + 1 tokens that all stand with probability P (the product of the draft model's own
probabilities of them) drafts another token only if P * a_i * t(B, 1) / B >= d + t(B, j + 3)
- t(B, j + 2): the token it may add, worth a token's plain decoding time, must cover its
drafting and the wider pass. E.g. with the worked example's costs below (a = 0.6, d = 25 ms,
t(1, 1) = 70 ms, t(1, 3) = 72, t(1, 4) = 75): after 1 token the bound is (25 + 2) / 42 = 0.64,
after 2 it is (25 + 3) / 42 = 0.67. Before any pass or draft was measured there are no bounds.

Worked example ("cost", B = 1): a = 0.6, d = 25 ms, t(1, 1) = t(1, 2) = 70 ms,
t(1, 3) = 72 ms, t(1, 4) = 75 ms: k = 0 gives 1 / 70 = 14.3 tok/s; k = 1 gives
1.6 / 95 = 16.8; k = 2 gives 1.96 / 122 = 16.1; k = 3 gives 2.18 / 150 = 14.5. So k = 1.

The acceptance rate is estimated per request from its verdicts, the most recent weighing most:
each drafted position up to the first rejection is a success, the first rejection a failure,
counts decay by `DECAY` per step and start from `PRIOR_WEIGHT` pseudo-positions at the rate of
all requests so far. Pass seconds are learned from the engine's own passes (an exponential
average per pass shape, `PassCosts`); a shape never run is read off its neighbours (linear
between them, flat beyond), which is optimistic about untried long drafts (trying them
measures them) but would keep a busy batch at long drafts it cannot afford, read off one
narrow pass. The engine therefore seeds the table with passes of 1 .. K + 1 tokens for each
new batch size before it is first priced (a server, for 1 .. max_num_seqs rows at its start;
`costs.seed_rows`), and scales the seeded costs by how the passes it runs compare with them
(contexts grow; the seeds are measured at one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdecode.drafters.base import check_draft_length_policy
from specdecode.engine.costs import PASS_AVERAGE, PassCosts, expected_tokens
from specdecode.types import Draft, Verdict

DECAY = 0.9  # weight of the older acceptance counts after each step
PRIOR_WEIGHT = 2.0  # pseudo-positions of the all-request rate a new request starts from
PROBE_EVERY = 8  # steps without a draft (per row of the batch) before the batch drafts again


@dataclass(slots=True)
class _Request:
    """One request's acceptance counts, how often it drafted when it could, and its limit."""

    successes: float
    failures: float
    limit: int
    offers: float = 1.0  # steps it could draft (decayed)
    hits: float = 1.0  # of those, steps it did draft (decayed)
    offered: bool = False  # its limit this step was > 0
    catch_up: int = 0  # catch-up tokens this step's draft pays for (module docstring)

    @property
    def rate(self) -> float:
        """Its acceptance rate: the decayed successes over all its decayed positions."""
        return self.successes / (self.successes + self.failures)


class DraftLength:
    """Chooses each request's draft limit (module docstring) and learns from every step.

    Args:
        policy: "fixed", "heuristic" or "cost".
        max_tokens: K, the drafter's num_speculative_tokens.
        trees: the drafter grows trees from its own distributions (`grows_trees`), which the
            cost rule prices whole (module docstring).
    """

    def __init__(self, policy: str, max_tokens: int, trees: bool = False) -> None:
        check_draft_length_policy(policy)
        self.policy = policy
        self.max_tokens = max_tokens
        self.trees = trees
        self.tree_depth = 0.0  # trees: running average depth of the trees drafted (D)
        self.passes = PassCosts()
        self.draft_s_per_token = 0.0  # running average drafting seconds per chain token or
        # tree level (d)
        self._successes = self._failures = 1.0  # all requests' counts (rate 0.5 at first)
        self._requests: dict[str, _Request] = {}
        self.last_limits: list[int] = []  # the latest step's limits (reported as a metric)
        self._idle_steps = 0  # "cost": steps in a row in which the batch drafted nothing
        self.setup_s_per_token = 0.0  # "cost": running average seconds per catch-up token

    def limits(
        self,
        request_ids: list[str],
        catch_up: Sequence[int] | None = None,
        remaining: Sequence[int] | None = None,
        pinned: Sequence[bool] | None = None,
    ) -> list[int]:
        """This step's draft limit per request (0..K), in order. `catch_up` (each request's
        tokens its drafter would read alone before drafting: `Drafter.catch_up`) and
        `remaining` (the new tokens it may still generate) let the cost rule price that
        one-time work (module docstring); without them it is left out.
        Under "cost" the `pinned` requests (seeded sampling: the same seed must give the same
        output, and the rule's choices follow measured seconds) always get K."""
        if self.policy == "fixed":
            chosen = [self.max_tokens] * len(request_ids)
        elif self.policy == "heuristic":
            chosen = [self._request(r).limit for r in request_ids]
        else:
            reqs = [self._request(r) for r in request_ids]
            pins = list(pinned) if pinned is not None else [False] * len(reqs)
            chosen = self._cost_limits(reqs, catch_up, remaining, pins)
            for req, k in zip(reqs, chosen, strict=True):
                req.offered = k > 0
        self.last_limits = chosen
        return chosen

    @property
    def prices_catch_up(self) -> bool:
        """Whether `limits` reads its `catch_up` argument (the "cost" rule); the other
        policies ignore it, so the engine need not ask the drafter."""
        return self.policy == "cost"

    def chain_bounds(
        self,
        request_ids: Sequence[str],
        limits: Sequence[int],
        pinned: Sequence[bool] | None = None,
    ) -> list[tuple[float, ...]]:
        """Under "cost", per request, the least probability a chain of j + 1 draft tokens
        must have to draft another (j = 0 .. limit - 2; module docstring); () under the other
        policies, for trees, before the costs are measured, for a limit below 2, or for the
        `pinned` requests (see `limits`)."""
        rows = len(request_ids)
        if self.policy != "cost" or self.trees or not rows or not self.draft_s_per_token:
            return [()] * rows
        passes: list[float] = []  # t(B, n) for n = 1 .. the longest limit + 1
        for n in range(1, max(limits, default=0) + 2):
            seconds = self.passes.estimate(rows, n)
            if seconds is None:
                return [()] * rows
            passes.append(seconds)
        token_s = passes[0] / rows  # a token's seconds in plain decoding
        costs = [  # seconds that drafting token j + 2 adds, j = 0 .. longest - 2
            self.draft_s_per_token + max(0.0, passes[j + 2] - passes[j + 1])
            for j in range(len(passes) - 2)
        ]
        out: list[tuple[float, ...]] = []
        for i, (request_id, limit) in enumerate(zip(request_ids, limits, strict=True)):
            if pinned is not None and pinned[i]:
                out.append(())
                continue
            req = self._request(request_id)
            worth = req.rate * token_s
            out.append(
                tuple(c / worth if worth else float("inf") for c in costs[: max(limit - 1, 0)])
            )
        return out

    def observe(
        self,
        request_ids: Sequence[str],
        drafts: Sequence[Draft],
        verdicts: Sequence[Verdict],
        draft_s: float,
        verify_s: float,
        setup_s: float = 0.0,
    ) -> None:
        """Learn from one step: drafting took `draft_s` seconds (one-time work such as a
        draft model's prompt prefills left out: `Drafter.setup_s`, here `setup_s`), the
        verification pass over every row's [last token, draft...] (padded to the longest)
        `verify_s`."""
        if self.policy == "fixed":
            return
        self._observe_catch_up([self._request(r) for r in request_ids], setup_s)
        longest = max(int(d.tokens.numel()) for d in drafts)
        self.passes.observe(len(drafts), 1 + longest, verify_s)
        depths = [d.tree.depth if d.tree is not None else int(d.tokens.numel()) for d in drafts]
        units = depths if self.trees else [int(d.tokens.numel()) for d in drafts]
        if sum(units):
            self.draft_s_per_token = _average(self.draft_s_per_token, draft_s / sum(units))
        for depth in depths if self.trees else ():
            if depth:
                self.tree_depth = _average(self.tree_depth, float(depth))
        for request_id, depth, verdict in zip(request_ids, depths, verdicts, strict=True):
            self._observe_verdict(request_id, depth, verdict.num_accepted)

    def _observe_verdict(self, request_id: str, drafted: int, accepted: int) -> None:
        """One request's verdict: `accepted` of its `drafted` positions (a tree's depth)."""
        req = self._request(request_id)
        if req.offered:
            req.offers = DECAY * req.offers + 1
            req.hits = DECAY * req.hits + int(drafted > 0)
            req.offered = False
        if not drafted:
            return
        rejected = int(accepted < drafted)
        req.successes = DECAY * req.successes + accepted
        req.failures = DECAY * req.failures + rejected
        self._successes += accepted
        self._failures += rejected
        if self.policy == "heuristic":
            step = 2 if accepted == drafted else -1
            req.limit = max(1, min(self.max_tokens, req.limit + step))

    def _observe_catch_up(self, reqs: list[_Request], setup_s: float) -> None:
        """The catch-up this step's drafts paid for: `setup_s` seconds over the catch-up
        tokens of the requests offered a draft (a running average per token)."""
        tokens = sum(r.catch_up for r in reqs if r.offered)
        if tokens and setup_s > 0:
            self.setup_s_per_token = _average(self.setup_s_per_token, setup_s / tokens)
        for req in reqs:
            req.catch_up = 0

    def release(self, request_id: str) -> None:
        """Forget a finished request (unknown ids are ignored)."""
        self._requests.pop(request_id, None)

    def _request(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            rate = self._successes / (self._successes + self._failures)
            req = _Request(PRIOR_WEIGHT * rate, PRIOR_WEIGHT * (1 - rate), self.max_tokens)
            self._requests[request_id] = req
        return req

    def _cost_limits(
        self,
        reqs: list[_Request],
        catch_up: Sequence[int] | None,
        remaining: Sequence[int] | None,
        pinned: Sequence[bool],
    ) -> list[int]:
        """The cost rule's limits: one k for the whole batch (module docstring), K for the
        `pinned` requests (`limits`); after PROBE_EVERY x B steps in which the batch of B
        drafted nothing, the whole batch drafts once (a probe costs every row a draft, so a
        bigger batch probes less often), unless not even drafts that are always accepted would
        pay at this batch size. With `catch_up` and `remaining`, a request not pinned whose
        catch-up would not pay gets 0 (`_priced_catch_up`)."""
        rates = [r.rate for r in reqs]
        available = [r.hits / r.offers for r in reqs]
        best = self.best_k(rates, available=available)
        if best == 0 and self.best_k([1.0] * len(reqs)) > 0:  # else no rate could pay
            self._idle_steps += 1
            if self._idle_steps > PROBE_EVERY * len(reqs):
                self._idle_steps = 0
                prior = self._successes / (self._successes + self._failures)
                best = max(1, self.best_k([prior] * len(reqs)))
        else:
            self._idle_steps = 0
        if (best or any(pinned)) and catch_up is not None and remaining is not None:
            return self._priced_catch_up(reqs, best, rates, available, catch_up, remaining, pinned)
        return [self.max_tokens if pin else best for pin in pinned]

    def _priced_catch_up(
        self,
        reqs: list[_Request],
        k: int,
        rates: Sequence[float],
        available: Sequence[float],
        catch_up: Sequence[int],
        remaining: Sequence[int],
        pinned: Sequence[bool],
    ) -> list[int]:
        """The batch's k per request (K for the `pinned`), or 0 for each request not pinned
        whose catch-up costs more than its drafts would save (module docstring), its requests
        accepting at `rates` and drafting in the share `available` of their steps; records
        what the drafting requests' drafts catch up on."""
        slow, fast = self._rate(0, rates, available), self._rate(k, rates, available)
        saved_per_token = len(reqs) * (1.0 / slow - 1.0 / fast) if slow and fast else 0.0
        out = []
        for req, tokens, left, pin in zip(reqs, catch_up, remaining, pinned, strict=True):
            limit = self.max_tokens if pin else k
            unpaid = tokens and left * saved_per_token < self.setup_s_per_token * tokens
            if not limit or (unpaid and not pin):
                out.append(0)
                continue
            req.catch_up = tokens
            out.append(limit)
        return out

    def _rate(
        self, k: int, acceptance: Sequence[float], available: Sequence[float]
    ) -> float | None:
        """Expected tokens per second of a step of k draft tokens per row (trees: K nodes
        over D levels, or none), for requests accepting at `acceptance` and drafting in the
        share `available` of their steps; None before any pass (or, for trees, any tree) was
        measured."""
        verify = self.passes.estimate(len(acceptance), k + 1)
        if verify is None or (self.trees and not self.tree_depth):
            return None
        depth = (self.tree_depth if k else 0.0) if self.trees else float(k)
        pairs = zip(acceptance, available, strict=True)
        gains = (v * (expected_tokens(a, depth) - 1) for a, v in pairs)
        seconds = sum(available) * depth * self.draft_s_per_token + verify
        return (len(acceptance) + sum(gains)) / seconds

    def best_k(
        self,
        acceptance: float | Sequence[float],
        rows: int | None = None,
        available: Sequence[float] | None = None,
    ) -> int:
        """The k in 0..K (trees: 0 or K) with the most expected tokens per second for a
        batch whose requests accept at the rates `acceptance` (one float: `rows` requests at
        that rate, default 1) and draft at all in the share `available` of the steps they may
        (default: always; a prompt-lookup drafter finds no match in some); K before any pass
        was measured."""
        if isinstance(acceptance, float | int):
            acceptance = [float(acceptance)] * (rows or 1)
        share = [1.0] * len(acceptance) if available is None else list(available)
        best, best_rate = self.max_tokens, 0.0
        for k in (0, self.max_tokens) if self.trees else range(self.max_tokens + 1):
            rate = self._rate(k, acceptance, share)
            if rate is None:
                return self.max_tokens
            if rate > best_rate:
                best, best_rate = k, rate
        return best


def _average(old: float, new: float) -> float:
    """A running average's next value: `new` itself when there is none yet (old = 0)."""
    return old + PASS_AVERAGE * (new - old) if old else new
