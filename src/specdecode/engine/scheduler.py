"""The scheduler: which waiting requests join the running batch before the next step.

Requests wait in arrival order (first come, first served: a request never overtakes an earlier
one). Between steps, `admit` moves the head of the queue into the running batch while all of
these hold after the move:

- at most `max_num_seqs` requests run;
- the step's tokens stay within `max_num_batched_tokens`: the prompts admitted now plus the
  verification tokens of every request that will run the step, the newly admitted included
  (1 + K each). The first request admitted in a step is admitted even when its prompt
  exceeds what is left of the budget, so no prompt waits forever (with `chunked_prefill`,
  the engine then prefills it a chunk per step while others decode);
- the KV cache holds at most `kv_cache_tokens` slots: the cache is paged (blocks of
  `BLOCK_TOKENS` slots, `cache/kv_cache.py`), so the check is the sum over the running
  requests, the new one included, of the blocks each holds through the next step: its
  committed tokens + 1 + K, in whole blocks (`step_blocks`; vLLM's rule: what a request holds
  now, not what it may come to hold).

Requests grow as they generate, so the running batch may come to need more blocks than the
cache holds: `preempt` then takes the newest running requests back to the head of the queue
(their rows are freed; each prefills its committed tokens again when it is admitted again,
most of them from the prefix cache, and goes on: nothing is lost, `Request.preempt`). A
request that could never fit, even alone, is refused when added (`check_fits`: its prompt +
max_tokens + the spare slots of a draft, `MAX_SPECULATIVE_TOKENS`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specdecode.cache.block_pool import BLOCK_TOKENS, blocks_for
from specdecode.drafters.base import MAX_SPECULATIVE_TOKENS
from specdecode.engine.request import Request
from specdecode.errors import UserError

DEFAULT_PREFIX_CACHE_TOKENS = 16384  # ~0.5 GB of bf16 keys and values for a 1.5B model


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of the running batch (module docstring).

    max_num_seqs: requests running at once (vLLM's name), >= 1.
    max_num_batched_tokens: tokens one step may feed (prompts admitted + verification), >= 1.
    kv_cache_tokens: KV slots the running batch may hold (in blocks of `BLOCK_TOKENS`); None
        = no limit (the cache grows as needed).
    prefix_cache_tokens: tokens of earlier sequences' keys and values kept for prompts that
        start the same way (`cache/prefix_cache.py`; vLLM's automatic prefix caching); 0 =
        off. Idle blocks of the same pool, beside the running batch's `kv_cache_tokens`.
    chunked_prefill: while requests decode, a prompt is prefilled a chunk per step, no
        larger than the step's verification tokens (at least one 16-token block, within
        `max_num_batched_tokens`), so the running requests keep their pace (`Engine.step`);
        False = each prompt whole in the step that admits it.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_cache_tokens: int | None = None
    prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"{name} must be an int >= 1, got {value!r}")
        tokens = self.kv_cache_tokens
        if tokens is not None and (
            not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1
        ):
            raise UserError(f"kv_cache_tokens must be None or an int >= 1, got {tokens!r}")
        cached = self.prefix_cache_tokens
        if (
            not isinstance(cached, int)
            or isinstance(cached, bool)
            or (cached != 0 and cached < BLOCK_TOKENS)
        ):
            raise UserError(
                f"prefix_cache_tokens must be 0 (off) or an int >= {BLOCK_TOKENS} (one block), "
                f"got {cached!r}"
            )

    @property
    def max_blocks(self) -> int | None:
        """KV blocks the running requests may hold (None: no limit)."""
        tokens = self.kv_cache_tokens
        return None if tokens is None else tokens // BLOCK_TOKENS


def kv_need(request: Request) -> int:
    """KV slots a request may fill: its prompt, every token it may generate, and a draft's
    spare slots (a draft is written before it is verified)."""
    return len(request.prompt_ids) + request.max_new + MAX_SPECULATIVE_TOKENS


def step_blocks(request: Request, draft_tokens: int) -> int:
    """KV blocks a request holds through its next step (its committed tokens, then 1 + K
    verified), or through its prefill."""
    return blocks_for(max(request.length + 1 + draft_tokens, len(request.prefill_ids)))


class Scheduler:
    """The waiting queue and the running batch (in cache-row order)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def check_fits(self, request: Request) -> None:
        """Refuse a request that could not run even alone within `kv_cache_tokens`."""
        limit = self.config.kv_cache_tokens
        need = kv_need(request)
        if limit is not None and blocks_for(need) > limit // BLOCK_TOKENS:
            raise UserError(
                f"the request needs {need} KV cache slots ({len(request.prompt_ids)} prompt "
                f"tokens + max_tokens {request.max_new} + {MAX_SPECULATIVE_TOKENS} for drafts) "
                f"but the cache holds {limit} ({limit // BLOCK_TOKENS} blocks of "
                f"{BLOCK_TOKENS}); lower max_tokens or shorten the prompt"
            )

    def add(self, request: Request) -> None:
        """Queue a request (after `check_fits`)."""
        self.check_fits(request)
        self.waiting.append(request)

    def admit(self, draft_tokens: int) -> list[Request]:
        """Move the waiting requests that fit (module docstring) to the end of the running
        batch and return them; each running request will verify up to `draft_tokens` + 1
        tokens this step."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens - len(self.running) * (1 + draft_tokens)
        blocks = self.blocks(draft_tokens)
        max_blocks = cfg.max_blocks
        admitted: list[Request] = []
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            head = self.waiting[0]
            prompt = len(head.prefill_ids)
            if prompt + 1 + draft_tokens > budget and admitted:
                break  # next step
            need = step_blocks(head, draft_tokens)
            if max_blocks is not None and blocks + need > max_blocks:
                break
            self.waiting.popleft()
            self.running.append(head)
            admitted.append(head)
            budget -= prompt + 1 + draft_tokens
            blocks += need
        return admitted

    def blocks(self, draft_tokens: int) -> int:
        """KV blocks the running requests hold through the next step (`step_blocks`)."""
        return sum(step_blocks(r, draft_tokens) for r in self.running)

    def preempt(self, draft_tokens: int) -> list[Request]:
        """While the running requests would outgrow the KV cache in the next step, take the
        newest one back to the head of the queue (`Request.preempt`); the oldest always
        stays. Returns those taken, newest first (their rows are the batch's last)."""
        taken: list[Request] = []
        limit = self.config.max_blocks
        if limit is None:
            return taken
        blocks = self.blocks(draft_tokens)
        while len(self.running) > 1 and blocks > limit:
            request = self.running.pop()
            blocks -= step_blocks(request, draft_tokens)  # before `preempt` changes it
            request.preempt()
            self.waiting.appendleft(request)
            taken.append(request)
        return taken

    def remove_waiting(self, request_id: str) -> Request | None:
        """Take a waiting request out of the queue (None if it is not waiting)."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return request
        return None


# Each prompt whole in one batched pass, no prefix cache: for measurements (`specdecode bench`,
# `plan`), which run each prompt again and again (a cache would skip the prefills their peers
# pay) one at a time, and for training's target answers, each asked once.
ONE_PASS_PREFILL = SchedulerConfig(prefix_cache_tokens=0, chunked_prefill=False)
