"""What a training run starts from (`start`): the target (an `LLM`), the example stream with
the bench filter (`default_examples`, `encoded_examples`), the draft vocabulary, a fresh or
resumed head with its optimizer, the teacher, the feature-store pass sources (`sources`) and the
held-out passes the head is scored on."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

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
from specdecode.heads.dflash_config import DFlashHeadConfig
from specdecode.heads.eagle3_config import Eagle3HeadConfig, default_aux_layers
from specdecode.heads.exit_head import ExitHeadConfig
from specdecode.llm import LLM
from specdecode.model.registry import cache_root
from specdecode.model.tokenizer import Tokenizer
from specdecode.train.checkpoint import TrainState, load_checkpoint
from specdecode.train.compute import head_compute_dtype, training_device
from specdecode.train.config import EAGLE3, TrainConfig
from specdecode.train.data import encode_example
from specdecode.train.dflash_model import TrainableDFlash, check_trainable, initial_dflash_weights
from specdecode.train.eagle3_model import TrainableEagle3, TrainableStateHead
from specdecode.train.exit_model import TrainableExitHead
from specdecode.train.extract import Encoded, PassSource
from specdecode.train.feature_store import FeatureStore, store_key
from specdecode.train.init import initial_exit_weights, initial_weights, target_output
from specdecode.train.mtp_model import (
    TrainableMtp,
    initial_mtp_weights,
    target_config_json,
)
from specdecode.train.objective import Teacher
from specdecode.train.target_pass import TargetPass

EVAL_START = 900  # held-out ShareGPT conversations 900.. score the head (training starts at 1000)


@dataclass
class Run:
    """What the training loop reads and moves.

    llm: the target. state: where the run stands (a resumed run's, else new).
    encoded: the stream's usable examples not yet trained on (`encoded_examples`; epoch 0
        reads at most `budget_examples`).
    draft_ids: the draft vocabulary (target token ids). head, optimizer: fresh or resumed.
    teacher: the target's distribution over the draft vocabulary.
    source: the training examples' passes (run, or read from the feature store).
    held: the held-out passes the head is scored on.
    compute: the head's matmul dtype. head_device: where the head and its batches live.
    """

    llm: LLM
    state: TrainState
    encoded: Iterator[Encoded]
    draft_ids: Tensor
    head: TrainableStateHead | TrainableExitHead | TrainableDFlash
    optimizer: torch.optim.Optimizer
    teacher: Teacher
    source: PassSource
    held: list[TargetPass]
    compute: torch.dtype
    head_device: torch.device


def start(
    config: TrainConfig,
    examples: Iterable[Example] | None = None,
    held_out: Sequence[Example] | None = None,
) -> Run:
    """Load the target and everything the loop needs (`Run`), resuming from the checkpoint
    when `config.resume` says so. `examples` / `held_out` replace the default data (tests);
    they are checked against the bench all the same."""
    device = training_device(config.device)
    saved = load_checkpoint(config)  # before the target loads: a refusal comes at once
    llm = LLM(
        config.model,
        dtype=config.dtype,
        quantization=config.quantization,
        device=str(device),
        scheduler=ONE_PASS_PREFILL,
    )
    stream, held_default, bench = default_examples()
    state = TrainState() if saved is None else TrainState(**saved["state"])
    encoded = encoded_examples(
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
    head = new_head(config, llm, draft_ids).to(device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, betas=(0.9, 0.95))
    if saved is not None:
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
    final = llm.model.config.num_layers
    rows, _ = target_output(llm.model_path, draft_ids)
    teacher = Teacher(rows.to(device), draft_ids.to(device), final)
    source, held_source = sources(config, llm, head.feature_layers)
    held = held_out_passes(
        held_source, held_default if held_out is None else held_out, llm.tokenizer, bench, config
    )
    compute = head_compute_dtype(config.head_dtype, device=device)
    return Run(
        llm, state, encoded, draft_ids, head, optimizer, teacher, source, held, compute, device
    )


def default_examples() -> tuple[Iterator[Example], Iterator[Example], BenchFilter]:
    """The training stream (ShareGPT from conversation 1000 on, interleaved with code), the
    held-out exchanges (from conversation EVAL_START), and the bench filter."""
    return (
        interleaved(sharegpt_examples(), stdlib_code_examples()),
        sharegpt_examples(EVAL_START),
        BenchFilter(bench_texts()),
    )


def encoded_examples(
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


def sources(
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


def new_head(
    config: TrainConfig, llm: LLM, draft_ids: Tensor
) -> TrainableStateHead | TrainableExitHead | TrainableDFlash:
    """A fresh trainable head of `config.method` for the target, started as `config.init` says."""
    target = llm.model.config
    if config.method == "dflash":
        check_trainable(target)
        layers = default_aux_layers(target.num_layers)
        cfg = DFlashHeadConfig.for_target(
            target, config.draft_layers, config.unroll + 1, layers, len(draft_ids)
        )
        rows, norm = target_output(llm.model_path, draft_ids)
        embed = llm.model.embed_tokens.weight
        weights = initial_dflash_weights(
            cfg, target, llm.model_path, draft_ids, config.init, config.seed, norm, embed
        )
        return TrainableDFlash(cfg, weights, embed, rows)
    if config.method == "mtp":
        rows, norm = target_output(llm.model_path, draft_ids)  # read once for both
        weights = initial_mtp_weights(
            target, llm.model_path, draft_ids, config.init, config.seed, norm
        )
        embed = llm.model.embed_tokens.weight
        return TrainableMtp(target, weights, embed, rows, target_config_json(llm.model_path))
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


def held_out_passes(
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
            encoded_examples(examples, tokenizer, config.max_length, bench), config.eval_examples
        )
    )
    if not encoded:
        raise UserError("no held-out example fits max_length: cannot score the head")
    passes = source.passes(encoded)
    source.store.flush()
    return passes
