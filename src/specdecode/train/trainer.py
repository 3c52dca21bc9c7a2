"""`specdecode train`: a draft head trained on the target's own states, on a CPU.

Methods: "eagle3" and "eagle3_parallel" (`train.eagle3_model`), "medusa" and "layer_skip"
(`train.exit_model`).
The loop, per optimizer step: take `batch_size` examples from the stream (ShareGPT exchanges
and standard-library code, never the bench's prompts: `train.data`), let the target answer
them (responses "target": self-distillation) or keep the dataset's answers ("dataset": teacher
forcing), run the target once over each sequence (`run_targets`: the states the head reads
and its final-normed state; on a GPU a batch's sequences run as rows of a few passes) unless
the feature store already holds it (`train.feature_store`; every pass run is kept there), and
fit the head's outputs (EAGLE-3's `unroll` TTT steps, Medusa's heads, the exit) to the
target's distribution over the draft vocabulary, the batch's sequences packed into rows
(`train.objective`). With `epochs` > 1 the run trains again on the first `budget_examples`
examples, read from the store in a shuffled order that batches similar lengths together
(`train.batches`). The target's passes and the head run on
`device` (a GPU: the target unquantized); the head's matmuls run in bf16 on a GPU and where
the CPU multiplies bf16 natively (AVX-512 BF16, AMX), else in fp32
(`compute.head_compute_dtype`); weights and optimizer state are fp32.

Every `eval_every` steps the head is scored on held-out ShareGPT exchanges
(`objective.evaluate`: top-1 agreement per TTT step and the tau it implies). Checkpoints
(`checkpoint.pt` in the output folder) let a stopped run resume where it was; the budget
(minutes and/or examples) counts the whole run across resumes. What a run starts from is
`train.start`'s; its state on disk, `train.checkpoint`'s; this module is the loop.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Sequence

import torch
from tqdm import tqdm

from specdecode.corpus.examples import Example
from specdecode.train.batches import epoch_batches
from specdecode.train.checkpoint import (
    TrainState,
    record,
    save_checkpoint,
    save_head,
)
from specdecode.train.config import TrainConfig
from specdecode.train.dflash_model import TrainableDFlash
from specdecode.train.eagle3_model import TrainableStateHead
from specdecode.train.exit_model import TrainableExitHead
from specdecode.train.extract import Encoded, PassSource
from specdecode.train.objective import (
    Batch,
    Evaluation,
    Teacher,
    batch_loss,
    evaluate,
    packed_batch,
)
from specdecode.train.start import Run, start
from specdecode.train.target_pass import TargetPass


def train(
    config: TrainConfig,
    examples: Iterable[Example] | None = None,
    held_out: Sequence[Example] | None = None,
    progress: bool = True,
) -> TrainState:
    """Train a head as `config` says and save it to `config.out` (config.json,
    model.safetensors, train_log.json); returns the final state. `examples` / `held_out`
    replace the default data (tests); they are checked against the bench all the same."""
    started = time.perf_counter()
    run = start(config, examples, held_out)
    state, source = run.state, run.source
    if state.step == 0:
        record(state, _evaluate(run, config), 0.0)
    base = state.seconds - (time.perf_counter() - started)  # setup is not budgeted

    def elapsed() -> float:
        return base + time.perf_counter() - started

    bar = _Progress(config, progress)
    last_checkpoint = time.perf_counter()
    epochs: dict[int, list[list[int]]] = {}  # a later epoch's batches
    final = run.llm.model.config.num_layers
    while not _spent(config, elapsed()):
        passes = _next_passes(config, state, run.encoded, source, epochs)
        if passes is None:  # the epoch is over
            if state.epoch + 1 >= config.epochs:
                break
            source.store.flush()
            state.epoch, state.position = state.epoch + 1, 0
            continue
        batch = packed_batch(passes, run.head.feature_layers, final, run.head_device)
        loss = _optimizer_step(
            run.head, run.optimizer, batch, state.step, config, run.teacher, run.compute
        )
        state.step += 1
        state.tokens += sum(len(p.tokens) for p in passes)
        state.answer_tokens += sum(len(p.tokens) - p.prompt_length for p in passes)
        postfix = {"loss": f"{loss:.3f}", "tokens": state.tokens, "epoch": state.epoch}
        if state.step % config.eval_every == 0:
            ev = _evaluate(run, config)
            record(state, ev, elapsed())
            postfix |= {"agree": f"{ev.agreement[0]:.2f}", "tau~": f"{ev.tau:.2f}"}
        bar.show(state, elapsed(), postfix)
        if time.perf_counter() - last_checkpoint > config.checkpoint_minutes * 60:
            state.seconds = elapsed()
            source.store.flush()
            _checkpoint(run, config)
            last_checkpoint = time.perf_counter()
    bar.close()
    source.store.flush()
    ev = _evaluate(run, config)
    if state.history[-1]["step"] != state.step:
        record(state, ev, elapsed())
    state.seconds = elapsed()
    _checkpoint(run, config)
    save_head(config, run.head, state, ev, source.computed)
    return state


class _Progress:
    """The run's progress bar: examples of every epoch under an example budget, else seconds
    of the minutes budget."""

    def __init__(self, config: TrainConfig, shown: bool) -> None:
        self.config = config
        self.total = (config.budget_examples or 0) * config.epochs
        self.bar = tqdm(
            total=self.total or int(config.budget_minutes * 60),
            initial=0,
            unit="ex" if self.total else "s",
            disable=not shown,
            desc=f"train {config.method}",
        )

    def show(self, state: TrainState, seconds: float, postfix: dict[str, object]) -> None:
        """Move the bar to where `state` stands after `seconds`, with `postfix` beside it."""
        config, total = self.config, self.total
        self.bar.set_postfix(postfix, refresh=False)
        done = state.examples if state.epoch == 0 else total // config.epochs * state.epoch
        done += state.position * config.batch_size
        self.bar.n = min(done if total else int(seconds), self.bar.total)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _evaluate(run: Run, config: TrainConfig) -> Evaluation:
    """The head scored on the held-out passes (`objective.evaluate`)."""
    return evaluate(run.head, run.held, config.unroll, run.teacher, run.compute)


def _checkpoint(run: Run, config: TrainConfig) -> None:
    """Save where the run stands (`checkpoint.save_checkpoint`) in the output folder."""
    save_checkpoint(config, run.head, run.optimizer, run.state, run.draft_ids)


def _next_passes(
    config: TrainConfig,
    state: TrainState,
    encoded: Iterator[Encoded],
    source: PassSource,
    epochs: dict[int, list[list[int]]],
) -> list[TargetPass] | None:
    """The next batch's passes (epoch 0: the stream's next examples, run or read; later
    epochs: the stored examples' batches, `batches.epoch_batches`, kept in `epochs`),
    advancing `state`; None when the epoch is over."""
    if state.epoch == 0:
        batch = list(itertools.islice(encoded, config.batch_size))
        if not batch:
            return None
        state.examples = batch[-1][0] + 1
        return source.passes(batch)
    if state.epoch not in epochs:
        store, budget = source.store, config.budget_examples or 0
        lengths = {i: store.length(i) for i in store.indices() if i < budget}
        epochs.clear()
        epochs[state.epoch] = epoch_batches(lengths, config.seed, state.epoch, config.batch_size)
    batches = epochs[state.epoch]
    if state.position >= len(batches):
        return None
    state.position += 1
    return [source.store.get(i) for i in batches[state.position - 1]]


def _optimizer_step(
    head: TrainableStateHead | TrainableExitHead | TrainableDFlash,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    step: int,
    config: TrainConfig,
    teacher: Teacher,
    compute: torch.dtype,
) -> float:
    """One AdamW step on a batch (learning rate warmed up linearly, matmuls in `compute`);
    returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = config.lr * min(1.0, (step + 1) / max(config.warmup_steps, 1))
    loss, _ = batch_loss(head, batch, config.unroll, teacher, compute)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def _spent(config: TrainConfig, seconds: float) -> bool:
    return config.budget_minutes is not None and seconds >= config.budget_minutes * 60
