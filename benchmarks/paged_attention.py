"""The paged cache's attention against the rectangular cache's: `kernels.decode_attention` over
[B, Hkv, S, D] keys and values, and over the same keys and values in 16-slot blocks scattered
over a pool in a random order (the worst case for prefetching) through a block table. Same
run, interleaved, median of 15 calls per shape (bf16, 12 query heads, 2 KV heads, D 128: the
1.5B's layer); the outputs are checked equal first.

    python benchmarks/paged_attention.py
"""

import statistics
import time

import torch

from specdecode import kernels

HEADS, KV_HEADS, DIM, BLOCK = 12, 2, 128, 16
SHAPES = [(1, 1000, 1), (16, 300, 1), (16, 300, 4), (4, 2000, 4)]  # rows, context, new tokens


def paged(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [B, Hkv, S, D] (S a multiple of the block) as a pool of blocks the table names."""
    rows, heads, slots, dim = x.shape
    blocks = x.view(rows, heads, slots // BLOCK, BLOCK, dim).transpose(1, 2)
    pool = torch.empty(table.numel(), heads, BLOCK, dim, dtype=x.dtype)
    pool[table.flatten()] = blocks.reshape(-1, heads, BLOCK, dim)
    return pool


def seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    torch.manual_seed(0)
    for rows, context, new in SHAPES:
        per_row = -(-(context + new) // BLOCK)
        slots = per_row * BLOCK
        q = torch.randn(rows, HEADS, new, DIM).bfloat16()
        k, v = (torch.randn(rows, KV_HEADS, slots, DIM).bfloat16() for _ in range(2))
        table = torch.randperm(rows * per_row).view(rows, per_row).contiguous()
        pk, pv = paged(k, table), paged(v, table)
        starts = [context] * rows

        def flat(k=k, v=v, q=q, starts=starts):
            return kernels.decode_attention(q, k, v, starts)

        def blocks(pk=pk, pv=pv, q=q, starts=starts, table=table):
            return kernels.decode_attention(q, pk, pv, starts, (), None, table)

        assert torch.equal(flat(), blocks())
        pairs = [(seconds(flat), seconds(blocks)) for _ in range(15)]
        ratios = [b / a for a, b in pairs]
        print(
            f"rows {rows} context {context} new {new}: rectangular "
            f"{1e3 * statistics.median(a for a, _ in pairs):.3f} ms, paged "
            f"{1e3 * statistics.median(b for _, b in pairs):.3f} ms, paged / rectangular "
            f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
