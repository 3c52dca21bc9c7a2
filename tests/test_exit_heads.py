"""Medusa heads and early-exit (layer_skip) drafting: lossless chains and trees, the reduced
vocabulary, the trainable heads equal to the inference heads, training that helps, exact
sampling, files and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_exit_head, build_tiny_model
from head_cases import (
    acceptance_rates,
    check_certify,
    check_greedy_and_sampled_in_one_batch,
    check_reduced_vocabulary,
    edited_head,
    sampled_runs,
)
from spec_cases import GREEDY, PROMPTS
from train_cases import chat_prompts, examples, train_config

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.layer_skip import EarlyExit
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.errors import UserError
from specdecode.heads.exit_head import ExitHead, ExitHeadConfig, load_exit_head, save_exit_head
from specdecode.heads.files import read_head_tensors
from specdecode.llm import LLM
from specdecode.model.loading import load_model
from specdecode.sampling_params import SamplingParams
from specdecode.train.exit_model import TrainableExitHead
from specdecode.train.init import initial_exit_weights
from specdecode.train.trainer import train

KINDS = ("medusa", "layer_skip")


@pytest.fixture(scope="module")
def heads(tiny_model_dir: Path) -> dict[str, Path]:
    return {
        kind: build_tiny_exit_head(tiny_model_dir, tiny_model_dir / f"{kind}-head", kind)
        for kind in KINDS
    }


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[list[int]]:
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    return [list(o.token_ids) for o in plain.generate(PROMPTS, GREEDY)]


def _llm(model_dir: Path, kind: str, head: Path, **spec: object) -> LLM:
    config = {"method": kind, "model": str(head), "num_speculative_tokens": 3, **spec}
    return LLM(str(model_dir), dtype="float32", speculative_config=config)


def _read(path: Path) -> tuple[ExitHeadConfig, dict[str, torch.Tensor]]:
    cfg = ExitHeadConfig.from_folder(path)
    return cfg, read_head_tensors(path, cfg.tensor_shapes(), {}, cfg.vocab_size)


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("medusa", {"num_speculative_tokens": 1}),
        ("medusa", {"num_speculative_tokens": 3}),
        ("medusa", {"num_speculative_tokens": 6, "tree_width": 2}),
        ("layer_skip", {"num_speculative_tokens": 4}),
        ("layer_skip", {"num_speculative_tokens": 6, "tree_width": 2, "tree_depth": 3}),
    ],
)
def test_greedy_equals_plain_batched_and_alone(
    tiny_model_dir: Path, heads: dict, expected: list[list[int]], kind: str, spec: dict
) -> None:
    llm = _llm(tiny_model_dir, kind, heads[kind], **spec)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert list(llm.generate(prompt, GREEDY)[0].token_ids) == want
    assert sum(o.metrics.spec.num_draft_tokens for o in outs) > 0
    drafter = llm.engine.drafter
    assert not getattr(drafter, "_states", None) and not getattr(drafter, "_caches", None)


@pytest.mark.parametrize("kind", KINDS)
def test_drafts_stay_in_the_draft_vocabulary_and_q_is_zero_outside(
    tiny_model_dir: Path, heads: dict, expected: list[list[int]], kind: str
) -> None:
    llm = _llm(tiny_model_dir, kind, heads[kind])
    drafter = llm.engine.drafter
    head = drafter.head if kind == "medusa" else drafter.model.head
    check_reduced_vocabulary(llm, head.draft_to_target, expected)


def test_medusa_greedy_chains_come_as_tokens_and_sampled_ones_with_their_q(
    tiny_model_dir: Path, heads: dict, expected: list[list[int]]
) -> None:
    llm = _llm(tiny_model_dir, "medusa", heads["medusa"])
    check_greedy_and_sampled_in_one_batch(llm, llm.engine.drafter.vocab_size, GREEDY, expected[0])


@pytest.mark.parametrize("kind", KINDS)
def test_trainable_head_equals_the_inference_head(
    tiny_model_dir: Path, heads: dict, kind: str
) -> None:
    """The training module's outputs equal the drafter's logits for the same target states;
    the early exit's states are the target's own block-E inputs (fp32)."""
    target = load_model(tiny_model_dir, dtype="float32")
    head = load_exit_head(heads[kind], target, None, kind)
    cfg, weights = _read(heads[kind])
    trainable = TrainableExitHead(cfg, weights)
    tokens = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.prefill([20], "cpu")
    layer = (cfg.feature_layer,)
    _, states = target(tokens, meta, target.new_cache(1, 20), hidden_layers=layer)  # [1, 20, h]
    with torch.no_grad():
        outputs = [trainable.logits(h) for h in trainable(states, tokens, 3)]
    logits = head(states[0])  # [20, K, Vd]
    for k, out in enumerate(outputs):
        torch.testing.assert_close(logits[:, k], out[0], atol=1e-5, rtol=1e-5)
    if kind == "layer_skip":
        early = EarlyExit(target, head)
        drafted, exits = early(tokens, meta, early.new_cache(1, 20))  # [1, 20, V], [1, 20, h]
        torch.testing.assert_close(exits, states, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(drafted[0, :, head.draft_to_target], logits[:, 0])
        assert torch.isinf(drafted).sum() == 20 * (300 - cfg.draft_vocab_size)


def _trained(tmp_path_factory: pytest.TempPathFactory, kind: str) -> tuple[Path, Path]:
    model_dir = build_tiny_model(tmp_path_factory.mktemp(f"{kind}_target"), "llama")
    out = tmp_path_factory.mktemp(f"{kind}_trained") / "head"
    # the exit has one output to learn from (Medusa three): a faster rate fits in 16 steps
    lr = 2e-3 if kind == "medusa" else 1e-2
    config = train_config(model_dir, out, method=kind, medusa_heads=3, exit_layer=2, lr=lr)
    train(config, examples(200), examples(4, 1000), progress=False)
    return model_dir, out


@pytest.fixture(scope="module")
def trained_medusa(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _trained(tmp_path_factory, "medusa")


@pytest.fixture(scope="module")
def trained_layer_skip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _trained(tmp_path_factory, "layer_skip")


@pytest.fixture(params=KINDS)
def trained(request: pytest.FixtureRequest) -> tuple[str, Path, Path]:
    model_dir, out = request.getfixturevalue(f"trained_{request.param}")
    return request.param, model_dir, out


def test_training_lowers_the_loss_and_raises_acceptance(trained: tuple[str, Path, Path]) -> None:
    kind, model_dir, out = trained
    log = json.loads((out / "train_log.json").read_text())
    first, last = log["history"][0], log["history"][-1]
    assert first["step"] == 0 and last["step"] == 16
    assert last["loss"] < first["loss"] - 0.5
    assert last["agree_0"] > first["agree_0"] + 0.1 and last["tau"] > first["tau"]
    assert len([k for k in last if k.startswith("agree_")]) == (3 if kind == "medusa" else 1)
    # the engine's acceptance on held-out prompts: trained head vs its starting point
    cfg, weights = _read(out)
    untrained = out.parent / "untrained"
    draft_ids = weights["d2t"] + torch.arange(cfg.draft_vocab_size)
    save_exit_head(untrained, cfg, initial_exit_weights(cfg, model_dir, draft_ids, "random", 0))
    prompts = chat_prompts(model_dir, examples(6, 2000))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    rates = acceptance_rates(
        [_llm(model_dir, kind, head) for head in (untrained, out)], prompts, params
    )
    assert rates[1] > rates[0] + 0.1, rates


def test_saved_head_drafts_like_the_trained_weights(trained: tuple[str, Path, Path]) -> None:
    """Save -> load gives the same drafts as a head built from the weights in memory."""
    kind, model_dir, out = trained
    target = load_model(model_dir, dtype="float32")
    cfg, weights = _read(out)
    trainable = TrainableExitHead(cfg, weights)
    trainable.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=False)["head"])
    in_memory = ExitHead(cfg, trainable.head_weights(), None).eval()
    heads = (in_memory, load_exit_head(out, target, None, kind))
    if kind == "medusa":
        drafters = [MedusaDrafter(head, 3) for head in heads]
    else:
        drafters = [DraftModelDrafter(EarlyExit(target, head), 3, 300) for head in heads]
    results = sampled_runs(model_dir, drafters)
    assert results[0] == results[1]


@pytest.mark.parametrize("biased", [False, True])
def test_sampling_matches_the_target_and_a_biased_verifier_fails(
    trained: tuple[str, Path, Path], monkeypatch: pytest.MonkeyPatch, biased: bool
) -> None:
    """`certify`'s chi-square test over whole continuations with a trained head (q neither
    one-hot nor p, zero outside the draft vocabulary): exact; a verifier that treats q as
    one-hot fails the same test."""
    kind, model_dir, out = trained
    llm = _llm(model_dir, kind, out, num_speculative_tokens=2)
    check_certify(llm, model_dir, monkeypatch, biased)


def test_config_json_says_what_the_head_is(trained: tuple[str, Path, Path]) -> None:
    kind, _, out = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["specdecode_head_type"] == kind and cfg["draft_vocab_size"] == 120
    assert cfg["feature_layer"] == (3 if kind == "medusa" else 2)
    assert cfg["num_heads"] == (3 if kind == "medusa" else 1)
    assert cfg["verifier"]["num_hidden_layers"] == 3
    assert cfg["specdecode"]["steps"] == 16 and cfg["specdecode"]["method"] == kind


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["verifier"].update(num_hidden_layers=5), "another target.*layers"),
        (lambda c: c.update(vocab_size=400), "another target.*vocabulary"),
        (lambda c: c.update(hidden_size=32), "another target.*hidden size"),
        (lambda c: c.update(draft_vocab_size=100), "do not match"),
    ],
)
def test_a_head_for_another_target_is_refused(
    tiny_model_dir: Path, heads: dict, tmp_path: Path, kind: str, edit, message: str
) -> None:
    with pytest.raises(UserError, match=message):
        _llm(tiny_model_dir, kind, edited_head(heads[kind], tmp_path, edit))


def test_bad_files_and_configs_are_clear_errors(
    tiny_model_dir: Path, heads: dict, tmp_path: Path
) -> None:
    with pytest.raises(UserError, match="holds a layer_skip head, not a medusa head"):
        _llm(tiny_model_dir, "medusa", heads["layer_skip"])
    with pytest.raises(UserError, match="no such medusa head folder"):
        _llm(tiny_model_dir, "medusa", tmp_path / "nowhere")
    with pytest.raises(UserError, match=r"at most 3 levels.*num_speculative_tokens 4"):
        _llm(tiny_model_dir, "medusa", heads["medusa"], num_speculative_tokens=4)
    with pytest.raises(UserError, match="tree_depth 4 is too deep"):
        _llm(
            tiny_model_dir,
            "medusa",
            heads["medusa"],
            num_speculative_tokens=8,
            tree_width=2,
            tree_depth=4,
        )
    out = edited_head(heads["medusa"], tmp_path, lambda c: None)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="truncated"):
        _llm(tiny_model_dir, "medusa", out)
    (out / "config.json").unlink()
    with pytest.raises(UserError, match=r"no config\.json"):
        _llm(tiny_model_dir, "medusa", out)
    with pytest.raises(UserError, match="exits before the last layer"):
        ExitHeadConfig("layer_skip", 3, 1, 64, 300, 100, 3)
    with pytest.raises(UserError, match=r"feature_layer must be in 1\.\.3"):
        ExitHeadConfig("medusa", 4, 2, 64, 300, 100, 3)
