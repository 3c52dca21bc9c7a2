"""Where one `specdecode train` optimizer step spends its time, per part, on this CPU.

Runs the trainer's own parts on the real data stream (ShareGPT + standard-library code, the
bench filter on): the target's passes (`run_target`, per example), the head's forward (the TTT
unroll), the loss (output head over answer positions, softmaxes), the backward, and AdamW's
step, each timed separately over `--steps` optimizer steps (after one untimed step). The
head's matmuls run in `--head-dtype` (auto: the trainer's choice for this CPU), the target's
activations in `--dtype`. The passes are also written to a feature store in a temporary
folder and read back, timed: what a later epoch (or run) pays instead of the target.

Prints per part the median ms per step and the target tokens per second the step reaches, with
the target's passes (a first epoch) and with the store's reads (a later one). With
`--compare-layouts`, the head's step (forward, loss, backward) on each timed batch also runs
with one sequence a row (the layout before `objective.packed_batch`), interleaved with the
packed rows (A B B A per batch), and the ratio of their times is printed.

Usage: python benchmarks/train_profile.py [--model qwen2.5-coder-1.5b] [--quantization int8]
       [--batch-size 4] [--max-length 512] [--steps 3] [--draft-vocab-size N]
       [--head-dtype auto] [--dtype bfloat16] [--compare-layouts]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from specdecode.corpus.vocab import draft_vocabulary
from specdecode.llm import LLM
from specdecode.train.compute import HEAD_DTYPES, head_compute_dtype
from specdecode.train.config import TrainConfig
from specdecode.train.eagle3_model import TrainableEagle3
from specdecode.train.exit_model import TrainableExitHead
from specdecode.train.feature_store import FeatureStore
from specdecode.train.init import target_output
from specdecode.train.objective import Batch, Teacher, batch_loss, packed_batch
from specdecode.train.start import default_examples, encoded_examples, new_head
from specdecode.train.target_pass import TargetPass, run_target

PARTS = ("target passes", "head forward + loss", "backward", "optimizer")
READ = "store read (later epochs)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--unroll", type=int, default=3)
    parser.add_argument("--draft-vocab-size", type=int, default=TrainConfig.draft_vocab_size)
    parser.add_argument("--head-dtype", default="auto", choices=HEAD_DTYPES)
    parser.add_argument("--dtype", default="bfloat16", help="the target's activations")
    parser.add_argument(
        "--compare-layouts", action="store_true", help="packed rows vs one sequence a row"
    )
    args = parser.parse_args()
    config = TrainConfig(
        model=args.model,
        out=None,  # type: ignore[arg-type]  # nothing is saved
        quantization=args.quantization,
        batch_size=args.batch_size,
        max_length=args.max_length,
        unroll=args.unroll,
        draft_vocab_size=args.draft_vocab_size,
        head_dtype=args.head_dtype,
        dtype=args.dtype,
    )
    compute = head_compute_dtype(config.head_dtype)
    llm = LLM(config.model, dtype=config.dtype, quantization=config.quantization)
    stream, _, bench = default_examples()
    encoded = encoded_examples(stream, llm.tokenizer, config.max_length, bench)
    first = list(itertools.islice(encoded, 200))
    vocab = llm.model.config.vocab_size
    draft_ids = draft_vocabulary(
        [ids[n:] for _, ids, n in first],
        config.draft_vocab_size,
        vocab,
        llm.tokenizer.eos_token_ids,
    )
    head = new_head(config, llm, draft_ids)
    final = llm.model.config.num_layers
    layers = (*head.feature_layers, final)
    teacher = Teacher(target_output(llm.model_path, draft_ids)[0], draft_ids, final)
    folder = tempfile.TemporaryDirectory()
    store = FeatureStore(Path(folder.name), {"layers": list(layers)})
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, betas=(0.9, 0.95))
    times: dict[str, list[float]] = defaultdict(list)
    reads: list[float] = []
    cpu = torch.device("cpu")
    tokens: list[int] = []
    timed: list[list[TargetPass]] = []  # the timed steps' passes
    columns: list[int] = []  # the head's columns per step: rows x the bucketed longest
    batches = itertools.islice(
        (first[i : i + args.batch_size] for i in range(0, len(first), args.batch_size)),
        args.steps + 1,
    )
    for step, batch in enumerate(batches):
        stamps = [time.perf_counter()]
        passes = [run_target(llm.model, ids, n, layers) for _, ids, n in batch]
        stamps.append(time.perf_counter())
        packed = packed_batch(passes, head.feature_layers, final, cpu)
        loss, _ = batch_loss(head, packed, config.unroll, teacher, compute)
        stamps.append(time.perf_counter())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        stamps.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        stamps.append(time.perf_counter())
        for (index, _, _), p in zip(batch, passes, strict=True):
            store.put(index, p)
        store.flush()
        read_start = time.perf_counter()
        again = [store.get(index) for index, _, _ in batch]
        read_ms = (time.perf_counter() - read_start) * 1e3
        assert all(torch.equal(a.states, p.states) for a, p in zip(again, passes, strict=True))
        if step > 0:  # the first step is untimed (allocations, oneDNN's first calls)
            for part, start, end in zip(PARTS, stamps[:-1], stamps[1:], strict=True):
                times[part].append((end - start) * 1e3)
            reads.append(read_ms)
            tokens.append(sum(len(p.tokens) for p in passes))
            timed.append(passes)
            columns.append(packed.tokens.numel())
    total = [sum(parts) for parts in zip(*times.values(), strict=True)]
    print(
        f"{args.model} ({args.quantization} target passes, {args.dtype} activations), "
        f"head {compute}, "
        f"{args.batch_size} examples/step, {statistics.median(tokens)} tokens/step (median), "
        f"{sum(tokens) / sum(columns):.0%} of the head's columns real (packed rows)"
    )
    for part, values in times.items():
        print(f"  {part:22s} {statistics.median(values):9.0f} ms")
    step_ms = statistics.median(total)
    print(
        f"  {'step':22s} {step_ms:9.0f} ms = {statistics.median(tokens) / step_ms * 1e3:.0f} "
        "target tokens/s"
    )
    later = [t - times[PARTS[0]][i] + reads[i] for i, t in enumerate(total)]
    later_ms = statistics.median(later)
    print(f"  {READ:22s} {statistics.median(reads):9.0f} ms")
    print(
        f"  {'later epoch step':22s} {later_ms:9.0f} ms = "
        f"{statistics.median(tokens) / later_ms * 1e3:.0f} target tokens/s"
    )
    folder.cleanup()
    if args.compare_layouts:
        _compare_layouts(timed, head, final, config.unroll, teacher, compute)


def _compare_layouts(
    timed: list[list[TargetPass]],
    head: TrainableEagle3 | TrainableExitHead,
    final: int,
    unroll: int,
    teacher: Teacher,
    compute: torch.dtype,
) -> None:
    """Time the head's step on packed rows and on one sequence a row, A B B A per batch."""

    def step(batch: Batch) -> float:
        start = time.perf_counter()
        loss, _ = batch_loss(head, batch, unroll, teacher, compute)
        head.zero_grad(set_to_none=True)
        loss.backward()
        return time.perf_counter() - start

    ratios = []
    for passes in timed:
        packed = packed_batch(passes, head.feature_layers, final, torch.device("cpu"))
        alone = packed_batch(passes, head.feature_layers, final, torch.device("cpu"), pack=False)
        first, second, third, fourth = step(packed), step(alone), step(alone), step(packed)
        ratios.append((first + fourth) / (second + third))
        print(
            f"  packed {tuple(packed.tokens.shape)} vs one a row {tuple(alone.tokens.shape)}: "
            f"{(first + fourth) / 2 * 1e3:.0f} vs {(second + third) / 2 * 1e3:.0f} ms"
        )
    print(
        f"  head step, packed / one a row: median {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} batches)"
    )


if __name__ == "__main__":
    main()
