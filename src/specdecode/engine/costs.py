"""What speculation costs and yields, as the engine and every tool that plans it reads it: the
expected tokens of a step (`expected_tokens`), the seconds of verification passes measured
beforehand, in interleaved rounds (`pass_seconds`, `interleaved_seconds`), and the running
table of pass costs by shape (`PassCosts`) that the "cost" draft-length policy reads.
`specdecode plan`, `bench` and `serve` import these from here; nothing here imports them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.cache.kv_cache import KVCache
from specdecode.model.transformer import Transformer

PASS_AVERAGE = 0.2  # weight of a new pass's seconds in its shape's running average
PASS_CONTEXT = 256  # cached tokens before the passes measured to seed the table (`seed_rows`)

K = TypeVar("K")
Shape = tuple[int, int]  # a verification pass: (rows, tokens per row)


def expected_tokens(acceptance: float, k: float) -> float:
    """E[tokens per step] = (1 - a^(K+1)) / (1 - a) for acceptance a in [0, 1] and K >= 0 (a
    mean tree depth may be fractional)."""
    if not 0.0 <= acceptance <= 1.0 or k < 0:
        raise ValueError(f"need 0 <= acceptance <= 1 and K >= 0, got {acceptance} and {k}")
    if acceptance == 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def interleaved_seconds(
    passes: Mapping[K, Callable[[], object]], repeats: int = 5, fastest: bool = False
) -> dict[K, float]:
    """Median seconds (with `fastest`, the least: noise only adds time) of each of `passes`
    over `repeats` rounds, after one untimed round. A round runs every pass once, in turn: in
    the order given, the next round in the reverse order, and so on, so that a drift in the
    machine's speed (its memory bandwidth moves from minute to minute) reaches every pass
    alike, not only the ones timed last: the ratios between them are same-run ratios.

    Example: passes {1: a, 4: b}, repeats 2: a, b (untimed), then b, a, then a, b.
    """
    if repeats < 1 or not passes:
        raise ValueError("need repeats >= 1 and at least one pass")
    order = list(passes)
    times: dict[K, list[float]] = {key: [] for key in order}
    for round_ in range(repeats + 1):
        for key in order if round_ % 2 == 0 else reversed(order):
            t0 = time.perf_counter()
            passes[key]()
            if round_:
                times[key].append(time.perf_counter() - t0)
    pick = min if fastest else statistics.median
    return {key: pick(t) for key, t in times.items()}


@torch.inference_mode()
def verification_passes(
    model: Transformer, context: int, shapes: Sequence[Shape], seed: int = 0
) -> dict[Shape, Callable[[], None]]:
    """Per shape (rows, width): a callable that runs one forward pass of `rows` rows of
    `width` new tokens each (DECODE, as a verification pass, logits for every token), every
    row after the same `context` cached tokens, and rolls the rows back to them.

    One row is filled once (here) with `context` random tokens and copied to every row count's
    cache, so every pass sees the same context.
    """
    if context < 1 or not shapes or min(min(s) for s in shapes) < 1:
        raise ValueError("need context >= 1, shapes, and rows, widths >= 1")
    device = model.device
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    capacity = context + max(w for _, w in shapes)
    first = model.new_cache(1, capacity)
    prompt = torch.randint(vocab, (1, context), generator=gen)
    model(prompt.to(device), AttentionMetadata.prefill([context], device), first)
    caches = {1: first}
    passes = {}
    for rows, width in shapes:
        if rows not in caches:
            caches[rows] = model.new_cache(rows, capacity)
            caches[rows].load_prefix(first, context)
        tokens = torch.randint(vocab, (rows, width), generator=gen).to(device)
        meta = AttentionMetadata.contiguous(
            AttentionMode.DECODE, [context] * rows, [width] * rows, device
        )
        passes[(rows, width)] = _rolled_back_pass(model, tokens, meta, caches[rows], context)
    return passes


def _rolled_back_pass(
    model: Transformer, tokens: Tensor, meta: AttentionMetadata, cache: KVCache, context: int
) -> Callable[[], None]:
    """A callable: the pass of `tokens` ([rows, width]) over `cache`, then the rows rolled
    back to `context` cached tokens."""

    @torch.inference_mode()
    def run() -> None:
        model(tokens, meta, cache)
        if tokens.device.type == "cuda":
            torch.cuda.synchronize(tokens.device)
        cache.truncate(context)

    return run


def pass_seconds(
    model: Transformer,
    context: int,
    shapes: Sequence[Shape],
    repeats: int = 5,
    seed: int = 0,
    fastest: bool = False,
) -> dict[Shape, float]:
    """Median seconds (with `fastest`, the least) of each shape's verification pass
    (`verification_passes`), the shapes timed in interleaved rounds (`interleaved_seconds`)."""
    if repeats < 1:
        raise ValueError("need repeats >= 1")
    return interleaved_seconds(verification_passes(model, context, shapes, seed), repeats, fastest)


def seed_rows(model: Transformer, costs: PassCosts, max_tokens: int, rows: Sequence[int]) -> None:
    """Measure verification passes of each row count in `rows` and of 1, 2, 3, powers of two
    + 1 and K + 1 tokens per row (K = `max_tokens`) after PASS_CONTEXT cached tokens (the
    least of 3 timings, `pass_seconds`), and seed `costs` with them."""
    widest = max_tokens + 1
    widths = sorted({w for w in (1, 2, 3, *((1 << i) + 1 for i in range(7))) if w < widest})
    shapes = [(r, w) for r in rows for w in [*widths, widest]]
    context = min(PASS_CONTEXT, model.config.max_position_embeddings - widest)
    costs.seed(pass_seconds(model, context, shapes, 3, fastest=True))


def _along(points: dict[int, float], x: int) -> float:
    """points (x -> seconds, not empty) read at x: linear between the nearest, flat beyond."""
    if x in points:
        return points[x]
    below = [p for p in points if p < x]
    above = [p for p in points if p > x]
    if not above or not below:
        return points[max(below)] if not above else points[min(above)]
    lo, hi = max(below), min(above)
    return points[lo] + (x - lo) / (hi - lo) * (points[hi] - points[lo])


def nondecreasing(values: list[float]) -> list[float]:
    """The nondecreasing sequence closest to `values` in squared error (pool adjacent
    violators: a run that decreases is replaced by its mean). [1, 3, 2, 4] -> [1, 2.5, 2.5, 4]."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [mean for mean, count in blocks for _ in range(int(count))]


def _lookup(table: dict[Shape, float], rows: int, per_row: int) -> float | None:
    """`table` read at a shape: along the tokens per row within each measured row count,
    then along the row counts (`_along` both ways); None for an empty table."""
    by_rows: dict[int, dict[int, float]] = {}
    for (r, n), seconds in table.items():
        by_rows.setdefault(r, {})[n] = seconds
    if not by_rows:
        return None
    return _along({r: _along(points, per_row) for r, points in by_rows.items()}, rows)


class PassCosts:
    """Seconds of verification passes by shape (rows, tokens per row): passes measured
    beforehand (`seed`) and running averages of the passes run.

    A shape that has run is read as measured. Otherwise the seeded table is read there
    (`_lookup`), scaled by how the passes of the same row count that did run compare with the
    seeded table (the nearest tokens per row): a server seeds its table at a short context,
    and its passes slow down as the contexts grow. Without seeds, the passes run are read the
    same way.
    """

    def __init__(self) -> None:
        self.seconds: dict[Shape, float] = {}  # passes run: running averages
        self.seeded: dict[Shape, float] = {}  # passes measured beforehand

    def seed(self, seconds: dict[Shape, float]) -> None:
        """Start from pass costs measured beforehand ((rows, tokens per row) -> seconds), e.g.
        at a server's start, so that shapes a batch has not run yet are not guessed. Within
        each row count the costs are made nondecreasing in the tokens per row (a wider pass
        never costs less; `nondecreasing`), so one noisy timing cannot make it look so."""
        self.seeded.update(seconds)
        for rows in {r for r, _ in self.seeded}:
            widths = sorted(n for r, n in self.seeded if r == rows)
            fitted = nondecreasing([self.seeded[(rows, n)] for n in widths])
            self.seeded.update(((rows, n), t) for n, t in zip(widths, fitted, strict=True))

    def unseeded(self, rows: int) -> list[int]:
        """The row counts to measure (`seed_rows`) before a batch of `rows` rows is priced:
        none once a count of at least `rows` was seeded, else the powers of two above the
        largest one seeded, up to `rows`, and `rows` itself."""
        top = max((r for r, _ in self.seeded), default=0)
        if top >= rows:
            return []
        return sorted({1 << i for i in range(rows.bit_length()) if 1 << i > top} | {rows})

    def observe(self, rows: int, per_row: int, seconds: float) -> None:
        old = self.seconds.get((rows, per_row))
        new = seconds if old is None else old + PASS_AVERAGE * (seconds - old)
        self.seconds[(rows, per_row)] = new

    def estimate(self, rows: int, per_row: int) -> float | None:
        """Seconds of a pass of `rows` rows of `per_row` tokens (class docstring); None
        before any pass was measured or seeded."""
        if (rows, per_row) in self.seconds:
            return self.seconds[(rows, per_row)]
        seeded = _lookup(self.seeded, rows, per_row)
        if seeded is None:
            return _lookup(self.seconds, rows, per_row)
        ran = [n for r, n in self.seconds if r == rows]
        if not ran:
            return seeded
        near = min(ran, key=lambda n: (abs(n - per_row), n))
        scale = self.seconds[(rows, near)] / (_lookup(self.seeded, rows, near) or 1.0)
        return seeded * scale
