"""EAGLE-3 heads: lossless drafting (chains, trees, a reduced vocabulary), exact sampling,
the trainable head equal to the inference head, training that helps, files and bad input."""

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
    check_greedy_equals_plain,
    check_reduced_vocabulary,
    edited_head,
    sampled_runs,
)
from spec_cases import GREEDY, PROMPTS
from train_cases import chat_prompts, examples, train_config

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.corpus.examples import Example
from specdecode.drafters.eagle3 import Eagle3Drafter
from specdecode.errors import UserError
from specdecode.heads.eagle3 import (
    Eagle3Head,
    head_tensor_shapes,
    load_eagle3_head,
    read_head_weights,
)
from specdecode.heads.eagle3_config import Eagle3HeadConfig
from specdecode.llm import LLM
from specdecode.model.loading import load_model
from specdecode.sampling_params import SamplingParams
from specdecode.train import start
from specdecode.train.compute import head_compute_dtype
from specdecode.train.config import TrainConfig
from specdecode.train.eagle3_model import TrainableEagle3
from specdecode.train.init import target_output
from specdecode.train.objective import Teacher, batch_loss, packed_batch
from specdecode.train.start import new_head
from specdecode.train.target_pass import run_target
from specdecode.train.trainer import train


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir: Path) -> Path:
    return build_tiny_eagle3_head(tiny_model_dir, tiny_model_dir / "eagle3-head")


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[list[int]]:
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    return [list(o.token_ids) for o in plain.generate(PROMPTS, GREEDY)]


def _eagle(model_dir: Path, head_dir: Path, **spec: object) -> LLM:
    config = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 3, **spec}
    return LLM(str(model_dir), dtype="float32", speculative_config=config)


@pytest.mark.parametrize(
    "spec",
    [
        {"num_speculative_tokens": 1},
        {"num_speculative_tokens": 4},
        {"num_speculative_tokens": 6, "tree_width": 2, "tree_depth": 3},
        {"num_speculative_tokens": 8, "tree_width": 3},
    ],
)
def test_greedy_equals_plain_batched_and_alone(
    tiny_model_dir: Path, head_dir: Path, expected: list[list[int]], spec: dict
) -> None:
    check_greedy_equals_plain(_eagle(tiny_model_dir, head_dir, **spec), expected)


def test_drafts_stay_in_the_draft_vocabulary_and_q_is_zero_outside(
    tiny_model_dir: Path, head_dir: Path, expected: list[list[int]]
) -> None:
    """The reduced vocabulary: drafts and q only cover the head's tokens, while the target's
    output uses tokens outside it (and is unchanged)."""
    llm = _eagle(tiny_model_dir, head_dir)
    drafter = llm.engine.drafter
    check_reduced_vocabulary(llm, drafter.head.draft_to_target, expected)


def test_greedy_chains_come_as_tokens_and_sampled_ones_with_their_q(
    tiny_model_dir: Path, head_dir: Path, expected: list[list[int]]
) -> None:
    llm = _eagle(tiny_model_dir, head_dir)
    check_greedy_and_sampled_in_one_batch(llm, llm.engine.drafter.vocab_size, GREEDY, expected[0])


def test_trainable_head_equals_the_inference_head(tiny_model_dir: Path, head_dir: Path) -> None:
    """TTT step j of the training module gives, for the last committed entry, the logits the
    drafter computes for its (j + 1)-th token (fp32)."""
    target = load_model(tiny_model_dir, dtype="float32")
    head = load_eagle3_head(head_dir, target, None)
    cfg = head.config
    trainable = TrainableEagle3(cfg, read_head_weights(head_dir, cfg), target.embed_tokens.weight)
    tokens = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(1, 20)
    meta = AttentionMetadata.prefill([20], "cpu")
    _, states = target(tokens, meta, cache, hidden_layers=cfg.aux_layers)  # [1, 20, F]
    with torch.no_grad():
        steps = [trainable.logits(h) for h in trainable(states, tokens, 3)]
    n = 12  # committed entries 0..11
    head_cache = head.new_cache(1, 32)
    meta = AttentionMetadata.prefill([n], "cpu")
    logits, hidden = head(tokens[:, 1 : n + 1], head.fuse(states[:, :n]), meta, head_cache)
    torch.testing.assert_close(logits[0], steps[0][0, :n], atol=1e-5, rtol=1e-5)
    out = hidden[:, -1:]
    for j in (1, 2):
        meta = AttentionMetadata.contiguous(AttentionMode.DECODE, [n + j - 1], [1], "cpu")
        logits, out = head(tokens[:, n + j : n + j + 1], out, meta, head_cache)
        torch.testing.assert_close(logits[0, 0], steps[j][0, n - 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quantization", ["int8", None])
def test_the_native_layer_gives_the_torch_layers_bits(
    tiny_model_dir: Path, head_dir: Path, quantization: str | None
) -> None:
    """In bf16 (int8 or bf16 projections), a DECODE pass (as a TREE pass, the same call) runs
    the head's layer as one native call: the bits of its Python-level layer."""
    target = load_model(tiny_model_dir, dtype="bfloat16", quantization=quantization)
    head = load_eagle3_head(head_dir, target, quantization)
    assert head.native is not None
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.prefill([16], "cpu")
    layers = head.config.aux_layers
    _, states = target(tokens, meta, target.new_cache(1, 16), hidden_layers=layers)  # [1, 16, F]
    fused = head.fuse(states)  # [1, 16, h]
    runs = []
    for native in (head.native, None):
        head.native = native
        cache = head.new_cache(1, 32)
        out = [head(tokens[:, 1:9], fused[:, :8], AttentionMetadata.prefill([8], "cpu"), cache)]
        meta = AttentionMetadata.contiguous(AttentionMode.DECODE, [8], [3], "cpu")
        out.append(head(tokens[:, 9:12], fused[:, 8:11], meta, cache))
        runs.append(out)
    for (logits, hidden), (want_logits, want_hidden) in zip(*runs, strict=True):
        assert torch.equal(logits, want_logits) and torch.equal(hidden, want_hidden)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama and a head trained on it for 64 examples."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("train_target"), "llama")
    out = tmp_path_factory.mktemp("trained") / "head"
    train(train_config(model_dir, out), examples(200), examples(4, 1000), progress=False)
    return model_dir, out


def test_training_lowers_the_loss_and_raises_acceptance(trained: tuple[Path, Path]) -> None:
    model_dir, out = trained
    log = json.loads((out / "train_log.json").read_text())
    first, last = log["history"][0], log["history"][-1]
    assert first["step"] == 0 and last["step"] == 16
    assert last["loss"] < first["loss"] - 0.5
    assert last["agree_0"] > first["agree_0"] + 0.1 and last["tau"] > first["tau"]
    # the engine's acceptance on held-out prompts: trained head vs its starting point
    cfg = Eagle3HeadConfig.from_folder(out)
    untrained = out.parent / "untrained"
    weights = read_head_weights(out, cfg)
    from specdecode.heads.eagle3 import save_eagle3_head
    from specdecode.train.init import initial_weights

    start = initial_weights(cfg, model_dir, weights["d2t"] + torch.arange(120), "random", 0)
    save_eagle3_head(untrained, cfg, start)
    prompts = chat_prompts(model_dir, examples(6, 2000))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    rates = acceptance_rates(
        [_eagle(model_dir, head) for head in (untrained, out)], prompts, params
    )
    assert rates[1] > rates[0] + 0.1, rates


def test_saved_head_drafts_like_the_trained_weights(trained: tuple[Path, Path]) -> None:
    """Save -> load gives the same drafts as a head built from the weights in memory."""
    model_dir, out = trained
    target = load_model(model_dir, dtype="float32")
    cfg = Eagle3HeadConfig.from_folder(out)
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=False)
    trainable = TrainableEagle3(cfg, read_head_weights(out, cfg), target.embed_tokens.weight)
    trainable.load_state_dict(checkpoint["head"])
    in_memory = Eagle3Head(cfg, trainable.head_weights(), target.embed_tokens, None, 256).eval()
    loaded = load_eagle3_head(out, target, None)
    results = sampled_runs(model_dir, [Eagle3Drafter(in_memory, 3), Eagle3Drafter(loaded, 3)])
    assert results[0] == results[1]


@pytest.mark.parametrize("biased", [False, True])
def test_sampling_matches_the_target_and_a_biased_verifier_fails(
    trained: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, biased: bool
) -> None:
    """`certify`'s chi-square test over whole continuations with a trained head (its q is
    neither one-hot nor p, and zero outside the draft vocabulary): exact; treating q as
    one-hot fails the same test."""
    model_dir, out = trained
    llm = _eagle(model_dir, out, num_speculative_tokens=2)
    check_certify(llm, model_dir, monkeypatch, biased)


def test_training_is_deterministic_and_resumes_exactly(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    model_dir, out = trained
    half = tmp_path / "half"
    train(
        train_config(model_dir, half, budget_examples=32),
        examples(200),
        examples(4, 1000),
        progress=False,
    )
    train(
        train_config(model_dir, half, resume=True), examples(200), examples(4, 1000), progress=False
    )
    assert (half / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_a_resume_with_other_settings_is_refused_naming_them(
    trained: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint keeps the settings that shape the head and its data: resuming it with
    another --unroll or --seed (or from a checkpoint that does not say) is a clear error,
    given before the target loads, and the checkpoint is left as it was."""
    model_dir, _ = trained
    out = tmp_path / "run"
    train(
        train_config(model_dir, out, budget_examples=8),
        examples(200),
        examples(4, 1000),
        progress=False,
    )
    checkpoint = out / "checkpoint.pt"
    before = checkpoint.read_bytes()

    def no_target(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target loaded before the checkpoint was checked")

    monkeypatch.setattr(start, "LLM", no_target)
    changed = train_config(model_dir, out, unroll=2, seed=1, resume=True)
    with pytest.raises(UserError, match=r"unroll 3 there, 2 now; seed 0 there, 1 now"):
        train(changed, examples(200), examples(4, 1000), progress=False)
    assert checkpoint.read_bytes() == before
    saved = torch.load(checkpoint, weights_only=False)
    del saved["run"]
    torch.save(saved, checkpoint)
    with pytest.raises(UserError, match="does not say which settings made it"):
        train(
            train_config(model_dir, out, resume=True),
            examples(200),
            examples(4, 1000),
            progress=False,
        )


def test_config_json_has_speculators_keys(trained: tuple[Path, Path]) -> None:
    _, out = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["draft_vocab_size"] == 120 and cfg["target_hidden_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 1, 0]
    assert cfg["speculators_config"]["verifier"]["num_hidden_layers"] == 3
    assert cfg["specdecode"]["steps"] == 16 and cfg["specdecode"]["tokens"] > 0


def test_a_head_from_another_trainer_loads(
    tiny_model_dir: Path, head_dir: Path, tmp_path: Path, expected: list[list[int]]
) -> None:
    """The original EAGLE-3 layout: a flat Llama config with draft_vocab_size, "midlayer."
    names, an fc bias, no layer ids (EAGLE-3's default for the target is used)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(head_dir / "model.safetensors"))
    renamed = {k.replace("layers.0.", "midlayer."): v for k, v in weights.items()}
    renamed["fc.bias"] = torch.zeros(64)
    save_file(renamed, str(tmp_path / "pytorch_model.safetensors"))
    layer = json.loads((head_dir / "config.json").read_text())["transformer_layer_config"]
    (tmp_path / "config.json").write_text(json.dumps({**layer, "draft_vocab_size": 200}))
    llm = _eagle(tiny_model_dir, tmp_path)
    assert [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY)] == expected


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["speculators_config"]["verifier"].update(num_hidden_layers=5), "layers"),
        (lambda c: c["transformer_layer_config"].update(vocab_size=400), "vocabulary"),
        (lambda c: c.update(target_hidden_size=32), "hidden size"),
    ],
)
def test_a_head_for_another_target_is_refused(
    tiny_model_dir: Path, head_dir: Path, tmp_path: Path, edit, message: str
) -> None:
    with pytest.raises(UserError, match=f"another target.*{message}"):
        _eagle(tiny_model_dir, edited_head(head_dir, tmp_path, edit))


def test_truncated_or_missing_head_files_are_clear_errors(
    tiny_model_dir: Path, head_dir: Path, tmp_path: Path
) -> None:
    out = edited_head(head_dir, tmp_path, lambda c: None)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="truncated"):
        _eagle(tiny_model_dir, out)
    with pytest.raises(UserError, match="no such EAGLE-3 head folder"):
        _eagle(tiny_model_dir, tmp_path / "nowhere")
    (out / "config.json").unlink()
    with pytest.raises(UserError, match=r"no config\.json"):
        _eagle(tiny_model_dir, out)


def test_tensor_shapes_must_match_the_config(head_dir: Path) -> None:
    cfg = Eagle3HeadConfig.from_folder(head_dir)
    assert set(head_tensor_shapes(cfg)) <= set(read_head_weights(head_dir, cfg))
    smaller = Eagle3HeadConfig(cfg.layer, 100, cfg.target_hidden_size, cfg.aux_layers)
    with pytest.raises(UserError, match="do not match"):
        read_head_weights(head_dir, smaller)


def test_bad_training_configs_and_bench_prompts_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot train method 'hydra'"):
        TrainConfig(model="x", out=tmp_path, method="hydra")
    with pytest.raises(UserError, match="budget"):
        TrainConfig(model="x", out=tmp_path, budget_minutes=None)
    with pytest.raises(UserError, match="responses"):
        TrainConfig(model="x", out=tmp_path, responses="teacher")
    with pytest.raises(UserError, match="unknown head dtype 'fp8'; allowed: auto, bfloat16"):
        TrainConfig(model="x", out=tmp_path, head_dtype="fp8")


def test_the_heads_compute_dtype_follows_the_cpus_bf16_support() -> None:
    assert head_compute_dtype("auto", frozenset({"avx2", "fma"})) == torch.float32
    assert head_compute_dtype("auto", frozenset({"avx512f", "avx512_bf16"})) == torch.bfloat16
    assert head_compute_dtype("auto", frozenset({"amx_bf16"})) == torch.bfloat16
    assert head_compute_dtype("auto", frozenset({"asimd", "bf16"})) == torch.bfloat16  # ARM64
    assert head_compute_dtype("bfloat16", frozenset()) == torch.bfloat16
    assert head_compute_dtype("float32", frozenset({"amx_bf16"})) == torch.float32


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_the_loss_is_the_same_in_either_compute_dtype(
    trained: tuple[Path, Path], compute: torch.dtype
) -> None:
    """fp32 matmuls (CPUs without native bf16) and bf16 autocast train the same objective:
    the loss of one batch agrees to bf16's precision, and its gradient flows in both."""
    model_dir, _ = trained
    llm = LLM(str(model_dir), dtype="float32")
    config = train_config(model_dir, Path("unused"))
    head = new_head(config, llm, torch.arange(120))
    ids = chat_prompts(model_dir, examples(2, 3000))
    final = llm.model.config.num_layers
    layers = (*head.feature_layers, final)
    passes = [
        run_target(llm.model, p["prompt_token_ids"] + [5, 6, 7, 8], len(p["prompt_token_ids"]),
                   layers)
        for p in ids
    ]  # fmt: skip
    teacher = Teacher(target_output(model_dir, torch.arange(120))[0], torch.arange(120), final)
    batch = packed_batch(passes, head.feature_layers, final, torch.device("cpu"))
    reference, _ = batch_loss(head, batch, 3, teacher, torch.float32)
    loss, _ = batch_loss(head, batch, 3, teacher, compute)
    loss.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=2e-2)
    assert head.p("fc.weight").grad is not None and head.p("fc.weight").grad.abs().sum() > 0


def test_a_bench_prompt_in_the_training_data_is_refused(tmp_path: Path) -> None:
    from specdecode.corpus.examples import BenchFilter, bench_texts
    from specdecode.corpus.prompts import load_prompts

    bench = BenchFilter(bench_texts())
    chat = load_prompts(["chat"], 1)[0].messages[-1]["content"]
    code = load_prompts(["code"], 1)[0].messages[-1]["content"]
    assert bench.touches(Example("x", "Please answer: " + chat[10:200], ""))
    assert bench.touches(Example("y", "hi", "Sure:\n" + code[40:300]))
    assert not any(bench.touches(e) for e in examples(20))
