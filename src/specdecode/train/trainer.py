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
(minutes and/or examples) counts the whole run across resumes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from specdecode.corpus.examples import (
    BenchFilter,
    Example,
    bench_texts,
    interleaved,
    sharegpt_examples,
    stdlib_code_examples,
)
from specdecode.corpus.vocab import draft_vocabulary
from specdecode.engine.scheduler import ONE_PASS_PREFILL
from specdecode.errors import UserError
from specdecode.heads.eagle3_config import Eagle3HeadConfig, default_aux_layers
from specdecode.heads.exit_head import ExitHeadConfig
from specdecode.llm import LLM
from specdecode.model.loading import parse_dtype
from specdecode.model.registry import cache_root
from specdecode.model.tokenizer import Tokenizer
from specdecode.train.batches import epoch_batches
from specdecode.train.compute import head_compute_dtype, training_device
from specdecode.train.config import EAGLE3, TrainConfig
from specdecode.train.data import encode_example
from specdecode.train.eagle3_model import TrainableEagle3
from specdecode.train.exit_model import TrainableExitHead
from specdecode.train.extract import Encoded, PassSource
from specdecode.train.feature_store import FeatureStore, store_key
from specdecode.train.init import initial_exit_weights, initial_weights, target_output
from specdecode.train.objective import (
    Batch,
    Evaluation,
    Teacher,
    batch_loss,
    evaluate,
    packed_batch,
)
from specdecode.train.target_pass import TargetPass

EVAL_START = 900  # held-out ShareGPT conversations 900.. score the head (training starts at 1000)
CHECKPOINT = "checkpoint.pt"
LOG = "train_log.json"


@dataclass
class TrainState:
    """Where a run stands (saved in checkpoints)."""

    step: int = 0
    epoch: int = 0  # 0: reading the stream; e > 0: the e-th pass over the stored examples
    examples: int = 0  # examples consumed from the stream (skipped ones included)
    position: int = 0  # batches of this epoch trained on (epochs > 0)
    tokens: int = 0  # sequence tokens the head trained on
    answer_tokens: int = 0  # of which answer tokens (the loss covers these)
    seconds: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)  # evaluations


def default_examples() -> tuple[Iterator[Example], Iterator[Example], BenchFilter]:
    """The training stream (ShareGPT from conversation 1000 on, interleaved with code), the
    held-out exchanges (from conversation EVAL_START), and the bench filter."""
    return (
        interleaved(sharegpt_examples(), stdlib_code_examples()),
        sharegpt_examples(EVAL_START),
        BenchFilter(bench_texts()),
    )


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
    device = training_device(config.device)
    llm = LLM(
        config.model,
        dtype=config.dtype,
        quantization=config.quantization,
        device=str(device),
        scheduler=ONE_PASS_PREFILL,
    )
    stream, held_default, bench = default_examples()
    saved = _load_checkpoint(config)
    state = TrainState() if saved is None else TrainState(**saved["state"])
    encoded = _encoded(
        stream if examples is None else examples, llm.tokenizer, config.max_length, bench
    )
    if saved is None:
        first = list(itertools.islice(encoded, config.vocab_examples))
        vocab = llm.model.config.vocab_size
        draft_ids = draft_vocabulary(
            [ids[n:] for _, ids, n in first],
            min(config.draft_vocab_size, vocab),
            vocab,
            llm.tokenizer.eos_token_ids,
        )
        encoded = itertools.chain(first, encoded)
    else:
        draft_ids = saved["draft_ids"]
        encoded = (item for item in encoded if item[0] >= state.examples)
    if config.budget_examples is not None:  # epoch 0 reads the first budget_examples
        encoded = itertools.takewhile(lambda item: item[0] < config.budget_examples, encoded)
    head = _new_head(config, llm, draft_ids).to(device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, betas=(0.9, 0.95))
    if saved is not None:
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
    final = llm.model.config.num_layers
    rows, _ = target_output(llm.model_path, draft_ids)
    teacher = Teacher(rows.to(device), draft_ids.to(device), final)
    source, held_source = _sources(config, llm, head.feature_layers)
    held = _held_out_passes(
        held_source, held_default if held_out is None else held_out, llm.tokenizer, bench, config
    )
    compute = head_compute_dtype(config.head_dtype, device=device)
    if state.step == 0:
        _record(state, evaluate(head, held, config.unroll, teacher, compute), 0.0)
    base = state.seconds - (time.perf_counter() - started)  # setup is not budgeted

    def elapsed() -> float:
        return base + time.perf_counter() - started

    total = (config.budget_examples or 0) * config.epochs
    bar = tqdm(
        total=total or int(config.budget_minutes * 60),
        initial=0,
        unit="ex" if total else "s",
        disable=not progress,
        desc=f"train {config.method}",
    )
    last_checkpoint = time.perf_counter()
    epochs: dict[int, list[list[int]]] = {}  # a later epoch's batches
    while not _spent(config, elapsed()):
        passes = _next_passes(config, state, encoded, source, epochs)
        if passes is None:  # the epoch is over
            if state.epoch + 1 >= config.epochs:
                break
            source.store.flush()
            state.epoch, state.position = state.epoch + 1, 0
            continue
        batch = packed_batch(passes, head.feature_layers, final, device)
        loss = _optimizer_step(head, optimizer, batch, state.step, config, teacher, compute)
        state.step += 1
        state.tokens += sum(len(p.tokens) for p in passes)
        state.answer_tokens += sum(len(p.tokens) - p.prompt_length for p in passes)
        postfix = {"loss": f"{loss:.3f}", "tokens": state.tokens, "epoch": state.epoch}
        if state.step % config.eval_every == 0:
            ev = evaluate(head, held, config.unroll, teacher, compute)
            _record(state, ev, elapsed())
            postfix |= {"agree": f"{ev.agreement[0]:.2f}", "tau~": f"{ev.tau:.2f}"}
        bar.set_postfix(postfix, refresh=False)
        done = state.examples if state.epoch == 0 else total // config.epochs * state.epoch
        done += state.position * config.batch_size
        bar.n = min(done if total else int(elapsed()), bar.total)
        bar.refresh()
        if time.perf_counter() - last_checkpoint > config.checkpoint_minutes * 60:
            state.seconds = elapsed()
            source.store.flush()
            _save_checkpoint(config.out / CHECKPOINT, head, optimizer, state, draft_ids)
            last_checkpoint = time.perf_counter()
    bar.close()
    source.store.flush()
    ev = evaluate(head, held, config.unroll, teacher, compute)
    if state.history[-1]["step"] != state.step:
        _record(state, ev, elapsed())
    state.seconds = elapsed()
    _save_checkpoint(config.out / CHECKPOINT, head, optimizer, state, draft_ids)
    _save_head(config, head, state, ev, source.computed)
    return state


def _sources(
    config: TrainConfig, llm: LLM, head_layers: tuple[int, ...]
) -> tuple[PassSource, PassSource]:
    """The training examples' and the held-out examples' pass sources, over the feature store
    (`features_folder`; held-out passes in its "held-out" subfolder)."""
    final = llm.model.config.num_layers
    # every store also keeps EAGLE-3's layers, so that Medusa and EAGLE-3 runs share one
    layers = tuple(sorted({*head_layers, *default_aux_layers(final), final}))
    key = store_key(
        str(llm.model_path),
        llm.model.device.type,
        config.quantization,
        config.dtype,
        layers,
        config.max_length,
        config.responses,
        config.max_answer_tokens,
    )
    root = features_folder(config, key)
    # a GPU runs a batch's new sequences as rows of a few passes; on a CPU the target's
    # prefill is compute-bound and padded rows only add work (docs/training.md)
    rows = config.batch_size if llm.model.device.type != "cpu" else 1
    args = (config.responses, config.max_answer_tokens, config.max_length, rows)
    return (
        PassSource(llm, FeatureStore(root, key), *args),
        PassSource(llm, FeatureStore(root / "held-out", key), *args),
    )


def features_folder(config: TrainConfig, key: dict[str, object]) -> Path:
    """`config.features`, or a folder under the cache named by the target and the store key."""
    if config.features is not None:
        return config.features
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / "features" / f"{Path(str(key['model'])).stem}-{digest}"


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


def _new_head(
    config: TrainConfig, llm: LLM, draft_ids: Tensor
) -> TrainableEagle3 | TrainableExitHead:
    """A fresh trainable head of `config.method` for the target, started as `config.init` says."""
    target = llm.model.config
    if config.method in EAGLE3:
        parallel = config.unroll if config.method == "eagle3_parallel" else 0
        cfg = Eagle3HeadConfig.for_target(target, len(draft_ids), config.model, parallel)
        return TrainableEagle3(
            cfg,
            initial_weights(cfg, llm.model_path, draft_ids, config.init, config.seed),
            llm.model.embed_tokens.weight,
        )
    exit_cfg = ExitHeadConfig.for_target(
        config.method,
        target,
        len(draft_ids),
        config.medusa_heads if config.method == "medusa" else 1,
        config.exit_layer,
        config.model,
    )
    return TrainableExitHead(
        exit_cfg,
        initial_exit_weights(exit_cfg, llm.model_path, draft_ids, config.init, config.seed),
    )


def _load_checkpoint(config: TrainConfig) -> dict | None:
    """The checkpoint to resume from (None for a fresh run)."""
    if not config.resume:
        return None
    path = config.out / CHECKPOINT
    if not path.is_file():
        raise UserError(f"nothing to resume: {path} does not exist")
    return torch.load(path, weights_only=False, map_location="cpu")


def _held_out_passes(
    source: PassSource,
    examples: Iterable[Example],
    tokenizer: Tokenizer,
    bench: BenchFilter,
    config: TrainConfig,
) -> list[TargetPass]:
    """The target's passes over the first `eval_examples` usable held-out examples (answered
    by the target itself under responses "target"), read from or kept in `source`'s store."""
    encoded = list(
        itertools.islice(
            _encoded(examples, tokenizer, config.max_length, bench), config.eval_examples
        )
    )
    if not encoded:
        raise UserError("no held-out example fits max_length: cannot score the head")
    passes = source.passes(encoded)
    source.store.flush()
    return passes


def _optimizer_step(
    head: TrainableEagle3 | TrainableExitHead,
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


def _save_head(
    config: TrainConfig,
    head: TrainableEagle3 | TrainableExitHead,
    state: TrainState,
    ev: Evaluation,
    computed: int,
) -> None:
    """Write the head folder (weights in save_dtype, a summary in config.json) and the log;
    `computed`: the target passes this run ran (the rest were read from the store)."""
    dtype = parse_dtype(config.save_dtype)
    weights = {
        n: (t.to(dtype) if t.is_floating_point() else t).cpu()
        for n, t in head.head_weights().items()
    }
    summary = {
        "method": config.method,
        "steps": state.step,
        "examples": state.examples,
        "epoch": state.epoch,
        "passes_run": computed,
        "tokens": state.tokens,
        "answer_tokens": state.answer_tokens,
        "minutes": round(state.seconds / 60, 2),
        "held_out_agreement": list(ev.agreement),
        "held_out_tau": ev.tau,
        "responses": config.responses,
        "head_dtype": str(
            head_compute_dtype(config.head_dtype, device=training_device(config.device))
        ).removeprefix("torch."),
        "device": config.device,
        "parameters": sum(p.numel() for p in head.parameters()),
    }
    head.save(config.out, weights, summary)
    log = {"config": _jsonable(asdict(config)), "summary": summary, "history": state.history}
    (config.out / LOG).write_text(json.dumps(log, indent=2) + "\n")


def _jsonable(d: dict) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


def _spent(config: TrainConfig, seconds: float) -> bool:
    return config.budget_minutes is not None and seconds >= config.budget_minutes * 60


def _encoded(
    examples: Iterable[Example], tokenizer: Tokenizer, max_length: int, bench: BenchFilter
) -> Iterator[tuple[int, list[int], int]]:
    """(index in the stream, token ids, prompt length) of the usable examples; an example
    that shares text with the bench is dropped (UserError: the stream must never hold one)."""
    for index, example in enumerate(examples):
        if bench.touches(example):
            raise UserError(
                f"training example {example.id!r} shares text with the bench's prompt sets; "
                "evaluation prompts are never trained on"
            )
        encoded = encode_example(tokenizer, example, max_length)
        if encoded is not None and len(encoded[0]) > encoded[1]:
            yield index, encoded[0], encoded[1]


def _record(state: TrainState, ev: Evaluation, seconds: float) -> None:
    state.history.append(
        {
            "step": state.step,
            "tokens": state.tokens,
            "answer_tokens": state.answer_tokens,
            "minutes": round(seconds / 60, 3),
            "loss": round(ev.loss, 4),
            "tau": round(ev.tau, 4),
            **{f"agree_{j}": round(a, 4) for j, a in enumerate(ev.agreement)},
        }
    )


def _save_checkpoint(
    path: Path,
    head: TrainableEagle3 | TrainableExitHead,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    draft_ids: Tensor,
) -> None:
    """Write the run's state atomically (a stop mid-write leaves the old checkpoint)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "head": head.state_dict(),
            "optimizer": optimizer.state_dict(),
            "state": asdict(state),
            "draft_ids": draft_ids,
        },
        tmp,
    )
    tmp.replace(path)
