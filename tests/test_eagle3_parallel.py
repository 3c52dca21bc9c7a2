"""Parallel EAGLE-3 heads (method "eagle3_parallel"): a whole draft from one head pass,
lossless (chains, trees, batched and alone), exact sampling, the trainable head equal to the
drafter's pass, training, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_eagle3_head, build_tiny_model
from head_cases import (
    acceptance_rates,
    check_certify,
    check_greedy_and_sampled_in_one_batch,
    passes_per_propose,
)
from spec_cases import GREEDY, PROMPTS
from train_cases import chat_prompts, examples, train_config

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.errors import UserError
from specdecode.heads.eagle3 import (
    load_eagle3_head,
    mask_token,
    read_head_weights,
    save_eagle3_head,
)
from specdecode.heads.eagle3_config import Eagle3HeadConfig
from specdecode.llm import LLM
from specdecode.model.loading import load_model
from specdecode.sampling_params import SamplingParams
from specdecode.train.eagle3_model import TrainableEagle3
from specdecode.train.init import initial_weights
from specdecode.train.objective import (
    Teacher,
    batch_loss,
    later_columns,
    packed_batch,
    read_columns,
)
from specdecode.train.target_pass import run_target
from specdecode.train.trainer import train

P = 4  # the head's levels


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir: Path) -> Path:
    return build_tiny_eagle3_head(
        tiny_model_dir, tiny_model_dir / "eagle3-parallel-head", parallel_tokens=P
    )


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[list[int]]:
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    return [list(o.token_ids) for o in plain.generate(PROMPTS, GREEDY)]


def _parallel(model_dir: Path, head_dir: Path, **spec: object) -> LLM:
    config = {"method": "eagle3_parallel", "model": str(head_dir), "num_speculative_tokens": 3}
    return LLM(str(model_dir), dtype="float32", speculative_config={**config, **spec})


@pytest.mark.parametrize(
    "spec",
    [
        {"num_speculative_tokens": 1},
        {"num_speculative_tokens": P},
        {"num_speculative_tokens": 6, "tree_width": 2, "tree_depth": 3},
        {"num_speculative_tokens": 8, "tree_width": 3},
    ],
)
def test_greedy_equals_plain_batched_and_alone_with_one_head_pass_a_step(
    tiny_model_dir: Path, head_dir: Path, expected: list[list[int]], spec: dict
) -> None:
    llm = _parallel(tiny_model_dir, head_dir, **spec)
    drafter = llm.engine.drafter
    per_propose = passes_per_propose(drafter, "forward")
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert list(llm.generate(prompt, GREEDY)[0].token_ids) == want
    assert sum(o.metrics.spec.num_draft_tokens for o in outs) > 0
    # one head pass per drafting request per step, however long its chain or deep its tree
    assert per_propose and all(n <= drafting for n, drafting in per_propose)
    assert not drafter._rows  # finished requests released their caches


def test_greedy_chains_come_as_tokens_and_sampled_ones_with_their_q(
    tiny_model_dir: Path, head_dir: Path, expected: list[list[int]]
) -> None:
    llm = _parallel(tiny_model_dir, head_dir)
    check_greedy_and_sampled_in_one_batch(llm, llm.engine.drafter.vocab_size, GREEDY, expected[0])


def test_the_trainable_head_scores_what_one_drafter_pass_drafts(
    tiny_model_dir: Path, head_dir: Path
) -> None:
    """Step j of the training module (mask entries for j > 0) gives, for the last committed
    entry, the logits of level j of the drafter's single pass (fp32)."""
    target = load_model(tiny_model_dir, dtype="float32")
    head = load_eagle3_head(head_dir, target, None)
    cfg = head.config
    trainable = TrainableEagle3(cfg, read_head_weights(head_dir, cfg), target.embed_tokens.weight)
    tokens = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    meta = AttentionMetadata.prefill([20], "cpu")
    _, states = target(tokens, meta, target.new_cache(1, 20), hidden_layers=cfg.aux_layers)
    with torch.no_grad():
        steps = [trainable.logits(h) for h in trainable(states, tokens, P)]
    n = 12  # committed entries 0..11: entry t reads (token t + 1, state t)
    ids = [*tokens[0, 1 : n + 1].tolist(), *[mask_token(j) for j in range(1, P)]]
    fused = head.fuse(states[0, :n])  # [n, h]
    hidden = torch.cat([fused, head.mask_features(fused[-1], P - 1)])
    meta = AttentionMetadata.prefill([n + P - 1], "cpu")
    index = torch.arange(n - 1, n + P - 1)[None]
    logits, _ = head(torch.tensor([ids]), hidden[None], meta, head.new_cache(1, 32), index)
    for j in range(P):
        torch.testing.assert_close(logits[0, j], steps[j][0, n - 1], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama and a parallel head (3 levels) trained on it for 64 examples."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("parallel_target"), "llama")
    out = tmp_path_factory.mktemp("parallel") / "head"
    config = train_config(model_dir, out, method="eagle3_parallel", unroll=3)
    train(config, examples(200), examples(4, 1000), progress=False)
    return model_dir, out


@pytest.mark.parametrize("biased", [False, True])
def test_sampling_matches_the_target_and_a_biased_verifier_fails(
    trained: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, biased: bool
) -> None:
    """`certify`'s chi-square test with a trained parallel head (its q at every level is
    neither one-hot nor p): exact; treating q as one-hot fails the same test."""
    model_dir, out = trained
    llm = _parallel(model_dir, out, num_speculative_tokens=2)
    check_certify(llm, model_dir, monkeypatch, biased)


def test_heads_and_methods_must_match_and_k_fit_the_levels(
    tiny_model_dir: Path, head_dir: Path, tmp_path: Path
) -> None:
    sequential = build_tiny_eagle3_head(tiny_model_dir, tmp_path / "sequential")
    with pytest.raises(UserError, match='use method "eagle3_parallel"'):
        LLM(
            str(tiny_model_dir),
            dtype="float32",
            speculative_config={
                "method": "eagle3",
                "model": str(head_dir),
                "num_speculative_tokens": 3,
            },
        )
    with pytest.raises(UserError, match=r'drafts token by token.*use method "eagle3"'):
        _parallel(tiny_model_dir, sequential)
    with pytest.raises(UserError, match=rf"at most {P} levels.*too long"):
        _parallel(tiny_model_dir, head_dir, num_speculative_tokens=P + 1)
    with pytest.raises(UserError, match="too deep"):
        _parallel(tiny_model_dir, head_dir, num_speculative_tokens=9, tree_width=2, tree_depth=5)
    config = json.loads((head_dir / "config.json").read_text())
    assert config["parallel_draft_tokens"] == P and config["parallel_mask_inputs"] == "anchored"
    assert Eagle3HeadConfig.from_folder(head_dir).parallel_tokens == P


@pytest.mark.parametrize("mask_inputs", [None, "learned"])
def test_a_parallel_head_whose_mask_entries_read_other_inputs_is_refused(
    head_dir: Path, tmp_path: Path, mask_inputs: str | None
) -> None:
    """A parallel head saved before its mask entries were anchored at the newest state (no
    "parallel_mask_inputs"), or naming a scheme this version does not draft with, is refused
    with what to do, not drafted from with other inputs than it was trained on."""
    config = json.loads((head_dir / "config.json").read_text())
    config.pop("parallel_mask_inputs")
    if mask_inputs is not None:
        config["parallel_mask_inputs"] = mask_inputs
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"parallel_mask_inputs.*'anchored'.*train the head again"):
        Eagle3HeadConfig.from_folder(tmp_path)


def test_training_a_parallel_head_raises_its_acceptance(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    """`train --method eagle3_parallel` (unroll = the levels): the loss falls, the held-out
    agreement rises, and in the engine the saved head's drafts are accepted more often than
    its starting point's."""
    model_dir, out = trained
    log = json.loads((out / "train_log.json").read_text())
    first, last = log["history"][0], log["history"][-1]
    assert last["loss"] < first["loss"] - 0.5 and last["agree_0"] > first["agree_0"] + 0.1
    assert Eagle3HeadConfig.from_folder(out).parallel_tokens == 3
    cfg = Eagle3HeadConfig.from_folder(out)
    weights = read_head_weights(out, cfg)
    start = initial_weights(cfg, model_dir, weights["d2t"] + torch.arange(120), "random", 0)
    save_eagle3_head(tmp_path / "untrained", cfg, start)
    prompts = chat_prompts(model_dir, examples(6, 2000))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    rates = acceptance_rates(
        [_parallel(model_dir, head) for head in (tmp_path / "untrained", out)], prompts, params
    )
    assert rates[1] > rates[0] + 0.1, rates


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_equals_plain_on_a_gpu(tiny_model_dir: Path, head_dir: Path) -> None:
    """The target, the head and the engine on CUDA (fp32): chains and trees give plain
    decoding's output on the same device (seen passing on an NVIDIA H200)."""
    plain = LLM(str(tiny_model_dir), dtype="float32", device="cuda")
    want = [list(o.token_ids) for o in plain.generate(PROMPTS, GREEDY)]
    for spec in (
        {"num_speculative_tokens": P},
        {"num_speculative_tokens": 6, "tree_width": 2, "tree_depth": 3},
    ):
        config = {"method": "eagle3_parallel", "model": str(head_dir), **spec}
        llm = LLM(str(tiny_model_dir), dtype="float32", device="cuda", speculative_config=config)
        outs = llm.generate(PROMPTS, GREEDY)
        assert [list(o.token_ids) for o in outs] == want
        assert sum(o.metrics.spec.num_draft_tokens for o in outs) > 0


def _passes(target, cfg: Eagle3HeadConfig, shapes, seed: int) -> list:
    """Target passes over random tokens: (length, prompt length) per pass."""
    gen = torch.Generator().manual_seed(seed)
    final = target.config.num_layers
    return [
        run_target(
            target,
            torch.randint(0, 300, (length,), generator=gen).tolist(),
            prompt,
            (*cfg.aux_layers, final),
        )
        for length, prompt in shapes
    ]


def _trainable(tiny_model_dir: Path, tmp_path: Path, parallel: int):
    head_dir = build_tiny_eagle3_head(tiny_model_dir, tmp_path / "h", parallel_tokens=parallel)
    target = load_model(tiny_model_dir, dtype="float32")
    cfg = Eagle3HeadConfig.from_folder(head_dir)
    trainable = TrainableEagle3(cfg, read_head_weights(head_dir, cfg), target.embed_tokens.weight)
    return target, cfg, trainable


@pytest.mark.parametrize("parallel", [0, P])
def test_later_steps_run_for_the_answer_columns_alone_with_the_same_outputs(
    tiny_model_dir: Path, tmp_path: Path, parallel: int
) -> None:
    """The trainer runs TTT steps > 0 only for the columns its loss reads
    (`objective.later_columns`): their outputs equal those of the full unroll at those
    columns, for sequential and parallel heads, and the batch loss is the same either way."""
    target, cfg, trainable = _trainable(tiny_model_dir, tmp_path, parallel)
    final = target.config.num_layers
    passes = _passes(target, cfg, ((100, 70), (80, 60), (120, 75)), 2)  # T 128, no two fit
    batch = packed_batch(passes, cfg.aux_layers, final, torch.device("cpu"))
    assert batch.tokens.shape == (3, 128) and not batch.starts.any()
    needed = read_columns(batch, 2) | read_columns(batch, 3) | read_columns(batch, 4)
    columns, slot = later_columns(needed)
    # rows by length: 120 (prompt 75), 100 (70), 80 (60); steps 1..3 (ahead 2..4) read
    # columns prompt - 1 - 4 .. length - 2 - 2
    assert needed.sum(1).tolist() == [116 - 70 + 1, 96 - 65 + 1, 76 - 55 + 1]
    assert columns.shape == (3, 64) and columns[0, 0] == 70 and columns[0, 46:].eq(116).all()
    assert slot[0, 70] == 0 and slot[0, 69] == -1 and slot[2, 76] == 21
    with torch.no_grad():
        full = trainable(batch.features, batch.tokens, 4)
        gathered = trainable(batch.features, batch.tokens, 4, batch.starts, columns)
    torch.testing.assert_close(gathered[0], full[0])
    rows = torch.arange(3)[:, None]
    for j in range(1, 4):
        assert gathered[j].shape[1] == 64 < full[j].shape[1] == 128
        torch.testing.assert_close(gathered[j], full[j][rows, columns], atol=1e-5, rtol=1e-5)
    # the loss over the gathered columns equals the loss of a head that gathers nothing
    draft_ids = torch.arange(cfg.draft_vocab_size)
    gen = torch.Generator().manual_seed(3)
    teacher_rows = torch.randn(cfg.draft_vocab_size, cfg.hidden_size, generator=gen)
    teacher = Teacher(teacher_rows, draft_ids, final)
    loss, _ = batch_loss(trainable, batch, 4, teacher, torch.float32)
    reference, _ = batch_loss(_Full(trainable), batch, 4, teacher, torch.float32)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)


def test_later_columns_lays_out_each_rows_needed_columns() -> None:
    needed = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]]).bool()
    columns, slot = later_columns(needed)
    assert columns.tolist() == [[1, 2, 4, 4, 4, 4], [0] * 6, [5] * 6]
    assert slot.tolist() == [[-1, 0, 1, -1, 2, -1], [-1] * 6, [-1] * 5 + [0]]


def test_packed_batch_puts_shorter_sequences_together(tiny_model_dir: Path) -> None:
    target = load_model(tiny_model_dir, dtype="float32")
    cfg = Eagle3HeadConfig.for_target(target.config, 120, "tiny", 0)
    passes = _passes(target, cfg, ((60, 40), (100, 70), (20, 10)), 4)
    batch = packed_batch(passes, cfg.aux_layers, target.config.num_layers, torch.device("cpu"))
    assert batch.tokens.shape == (2, 128)  # [100, 20] and [60]
    assert batch.tokens[0, :100].tolist() == passes[1].tokens.tolist()
    assert batch.tokens[0, 100:120].tolist() == passes[2].tokens.tolist()
    assert batch.tokens[1, :60].tolist() == passes[0].tokens.tolist()
    assert batch.starts[0].tolist() == [0] * 100 + [100] * 28  # padding: the last sequence's
    assert not batch.starts[1].any()
    answers = [i for i, a in enumerate(batch.answer[0].tolist()) if a]
    assert answers == [*range(69, 99), *range(109, 119)]
    torch.testing.assert_close(batch.features[0, 100:120], passes[2].at(cfg.aux_layers))
    # 109 is an answer position of the second sequence: its own column 107 reads it at
    # ahead 2, the first sequence's column 98 never does (ahead 11)
    assert batch.answer[0, 109] and read_columns(batch, 2)[0, 107]
    assert not read_columns(batch, 11)[0, 98]


@pytest.mark.parametrize("parallel", [0, P])
def test_packed_sequences_train_as_if_each_had_its_own_row(
    tiny_model_dir: Path, tmp_path: Path, parallel: int
) -> None:
    """Sequences packed into one row see only themselves at their own positions: the loss,
    the agreement counts, the gradients and each sequence's outputs equal those of the same
    sequences one per row."""
    target, cfg, trainable = _trainable(tiny_model_dir, tmp_path, parallel)
    final = target.config.num_layers
    passes = _passes(target, cfg, ((110, 70), (50, 30), (60, 45), (14, 6)), 5)
    cpu = torch.device("cpu")
    packed = packed_batch(passes, cfg.aux_layers, final, cpu)
    assert packed.tokens.shape == (2, 128)  # [110, 14] and [60, 50]
    alone = packed_batch(passes, cfg.aux_layers, final, cpu, pack=False)
    assert alone.tokens.shape == (4, 128) and not alone.starts.any()
    gen = torch.Generator().manual_seed(6)
    teacher_rows = torch.randn(cfg.draft_vocab_size, cfg.hidden_size, generator=gen)
    teacher = Teacher(teacher_rows, torch.arange(cfg.draft_vocab_size), final)
    grads = []
    for batch in (packed, alone):
        trainable.zero_grad(set_to_none=True)
        loss, counts = batch_loss(trainable, batch, 4, teacher, torch.float32)
        loss.backward()
        grads.append((loss.item(), counts, [p.grad.clone() for p in trainable.parameters()]))
    (loss, counts, grad), (loss_alone, counts_alone, grad_alone) = grads
    assert loss == pytest.approx(loss_alone, rel=1e-5)
    assert counts == counts_alone and counts[1][0] == sum(
        n - q for n, q in ((110, 70), (50, 30), (60, 45), (14, 6))
    )
    for g, h in zip(grad, grad_alone, strict=True):
        torch.testing.assert_close(g, h, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        out = trainable(packed.features, packed.tokens, 4, packed.starts)
        out_alone = trainable(alone.features, alone.tokens, 4, alone.starts)
    # pass 3 (14 tokens) sits in row 0 at columns 110..123; alone it is row 3, columns 0..13
    for j in range(4):
        torch.testing.assert_close(
            out[j][0, 110 : 110 + 14 - j - 2], out_alone[j][3, : 14 - j - 2], atol=1e-5, rtol=1e-5
        )


class _Full(torch.nn.Module):
    """A head that runs every step for every column (`columns` ignored)."""

    def __init__(self, head: TrainableEagle3) -> None:
        super().__init__()
        self.head, self.shift, self.gathers, self.gathers_first = head, head.shift, False, False

    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        steps: int,
        starts: torch.Tensor | None = None,
        columns: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        return self.head(features, tokens, steps, starts)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden)
