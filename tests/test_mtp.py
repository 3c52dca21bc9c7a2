"""MTP layers shipped inside a checkpoint (method "mtp"): each family's layout drafts what
the published modeling code computes, drafting is lossless (chains, trees, sampling), and a
folder without such a layer or of another model is a clear error.

No model that installs here ships MTP weights: the tiny random models get a layer written in
each family's names (`conftest.build_tiny_mtp`). The reference below is written from vLLM's
`deepseek_mtp.py`, `mimo_mtp.py` and `qwen3_next_mtp.py` (the names, the order of the
concatenation, the position-0 mask, which state a chained step reads), over Hugging Face's own
decoder layer and target model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, build_tiny_mtp
from head_cases import (
    acceptance_rates,
    check_certify,
    check_greedy_equals_plain,
    check_plan_prices,
)
from safetensors import safe_open
from safetensors.torch import save_file
from spec_cases import GREEDY, PROMPTS, FakeSeq
from train_cases import chat_prompts, examples, train_config

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.drafters.eagle3 import Eagle3Drafter
from specdecode.errors import UserError
from specdecode.heads.mtp import load_mtp_head
from specdecode.llm import LLM
from specdecode.model.config import ModelConfig
from specdecode.model.loading import load_model
from specdecode.sampling_params import SamplingParams
from specdecode.train.init import target_output
from specdecode.train.mtp_model import TrainableMtp, initial_mtp_weights, target_config_json
from specdecode.train.trainer import train
from specdecode.types import DraftBudget, TargetFeatures, TargetOutputs, Verdict

LAYOUTS = ("deepseek_v3", "qwen3_next", "mimo")

# Per family, as its published code reads the checkpoint: where the layer sits ({n}: the
# model's num_hidden_layers), its parts' names, where its block sits, whether the projection
# reads [hidden, embedding] (else [embedding, hidden]), whether position 0's embedding is
# zeroed, and whether a chained step reads the normed output (else the pre-norm one).
PUBLISHED = {
    "deepseek_v3": ("model.layers.{n}.", "enorm hnorm eh_proj shared_head.norm", "", 0, 1, 0),
    "qwen3_next": (
        "mtp.",
        "pre_fc_norm_embedding pre_fc_norm_hidden fc norm",
        "layers.0.",
        0,
        0,
        1,
    ),
    "mimo": (
        "model.mtp_layers.0.",
        "token_layernorm hidden_layernorm input_proj final_layernorm",
        "",
        1,
        1,
        1,
    ),
}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Reference:
    """An MTP layer computed from scratch by the published equations (no cache), over
    Hugging Face's decoder layer of the model's kind and its target model (fp32)."""

    def __init__(self, model_dir: Path, mtp_dir: Path, layout: str) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(model_dir)
        cfg._attn_implementation = "eager"
        self.target = AutoModelForCausalLM.from_pretrained(model_dir, config=cfg).eval()
        prefix, names, block, self.hidden_first, self.zero, self.normed = PUBLISHED[layout]
        prefix = prefix.format(n=cfg.num_hidden_layers)
        with safe_open(str(mtp_dir / "model.safetensors"), framework="pt") as f:
            w = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
        self.enorm, self.hnorm, self.proj, self.out_norm = (
            w[f"{prefix}{n}.weight"] for n in names.split()
        )
        self.own_head = w.get(f"{prefix}shared_head.head.weight")
        self.layer = AutoModelForCausalLM.from_config(cfg).model.layers[0].eval()
        at = prefix + block
        self.layer.load_state_dict({n: w[at + n] for n in self.layer.state_dict()})
        self.eps = cfg.rms_norm_eps

    @torch.no_grad()
    def states(self, ids: list[int]) -> torch.Tensor:
        """The target's final (normed) states after each token ([n, h])."""
        return self.target.model(torch.tensor([ids])).last_hidden_state[0]

    @torch.no_grad()
    def run(self, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries at positions 0..T-1 reading (tokens[t], hidden[t]), causal: (logits [T, V],
        the state a chained next entry reads [T, h])."""
        e = self.target.model.embed_tokens(torch.tensor(tokens))  # [T, h]
        positions = torch.arange(len(tokens))
        if self.zero:
            e = e * (positions != 0)[:, None]
        parts = [_rms(e, self.enorm, self.eps), _rms(hidden, self.hnorm, self.eps)]
        x = torch.cat(parts[::-1] if self.hidden_first else parts, -1) @ self.proj.T
        mask = torch.full((len(tokens), len(tokens)), float("-inf")).triu(1)[None, None]
        rope = self.target.model.rotary_emb(x[None], positions[None])
        y = self.layer(
            x[None], attention_mask=mask, position_ids=positions[None], position_embeddings=rope
        )
        y = (y[0] if isinstance(y, tuple) else y)[0]  # [T, h]
        normed = _rms(y, self.out_norm, self.eps)
        head = self.target.lm_head.weight if self.own_head is None else self.own_head
        return normed @ head.T, normed if self.normed else y

    def chain(self, ids: list[int], k: int) -> tuple[list[int], torch.Tensor]:
        """Greedy d1..dk after the committed `ids` (entry t reads ids[t + 1] and the target's
        state after ids[t]; a drafted entry its parent's output), and d1's logits."""
        states = self.states(ids)[:-1]
        tokens, drafted, first = ids[1:], [], None
        for _ in range(k):
            logits, out = self.run(tokens + drafted, states)
            first = logits[-1] if first is None else first
            drafted.append(int(logits[-1].argmax()))
            states = torch.cat([states, out[-1:]])
        return drafted, first


@pytest.fixture(scope="module", params=LAYOUTS)
def mtp_dir(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Path:
    return build_tiny_mtp(tiny_model_dir, tiny_model_dir / f"mtp-{request.param}", request.param)


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[list[int]]:
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    return [list(o.token_ids) for o in plain.generate(PROMPTS, GREEDY)]


def _mtp(model_dir: Path, mtp_dir: Path | None, **spec: object) -> LLM:
    config = {"method": "mtp", "num_speculative_tokens": 3, **spec}
    if mtp_dir is not None:
        config["model"] = str(mtp_dir)
    return LLM(str(model_dir), dtype="float32", speculative_config=config)


def test_each_layout_drafts_what_the_published_equations_give(
    tiny_model_dir: Path, mtp_dir: Path
) -> None:
    """The chained drafts and d1's logits of our head (its cache, native layer, one canonical
    form of the layout) equal the reference's, computed from scratch, given the same target
    states."""
    layout = mtp_dir.name.removeprefix("mtp-")
    ref = Reference(tiny_model_dir, mtp_dir, layout)
    target = load_model(tiny_model_dir, "float32")
    drafter = Eagle3Drafter(load_mtp_head(mtp_dir, target, None), 4)
    greedy = SamplingParams(temperature=0.0)
    for i, ids in enumerate([[5, 17, 42, 99, 3, 250], [7, 8], list(range(10, 40))]):
        seq = FakeSeq(str(i), ids, params=greedy)
        states = TargetFeatures(0, ref.states(ids)[:-1])
        drafter.commit(seq, Verdict(0, torch.tensor(ids[-1:])), TargetOutputs(hidden=states))
        want, first = ref.chain(ids, 4)
        assert drafter.propose([seq], [DraftBudget(4)])[0].tokens.tolist() == want
        head = drafter.head
        logits, _ = head(
            torch.tensor([ids[1:]]), states.hidden[None], *_prefill(head, len(ids) - 1)
        )
        torch.testing.assert_close(logits[0, -1], first, rtol=1e-4, atol=1e-4)


def _prefill(head, n: int):
    meta = AttentionMetadata.contiguous(AttentionMode.PREFILL, [0], [n], head.device)
    return meta, head.new_cache(1, n)


@pytest.mark.parametrize(
    "spec",
    [
        {"num_speculative_tokens": 3},
        {"num_speculative_tokens": 6, "tree_width": 2, "tree_depth": 3},
    ],
    ids=["chain", "tree"],
)
def test_greedy_equals_plain_batched_and_alone(
    tiny_model_dir: Path, mtp_dir: Path, expected: list[list[int]], spec: dict
) -> None:
    check_greedy_equals_plain(_mtp(tiny_model_dir, mtp_dir, **spec), expected)


@pytest.mark.parametrize("biased", [False, True])
def test_sampling_matches_the_target_and_a_biased_verifier_fails(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, biased: bool
) -> None:
    """`certify`'s chi-square test over whole continuations (the layer's q over the whole
    vocabulary, neither one-hot nor p): exact; a verifier treating q as one-hot fails it."""
    mtp_dir = build_tiny_mtp(tiny_model_dir, tiny_model_dir / "mtp-deepseek_v3", "deepseek_v3")
    llm = _mtp(tiny_model_dir, mtp_dir, num_speculative_tokens=2)
    check_certify(llm, tiny_model_dir, monkeypatch, biased)


def test_the_targets_own_folder_is_read_when_no_model_is_given(
    tiny_model_dir: Path, tmp_path: Path, expected: list[list[int]]
) -> None:
    """A checkpoint that ships its MTP layer beside the model's weights (a second
    safetensors file, as the publishers shard them; the Qwen2 model written as MiMo's
    config.json names it): the target loads as before and method "mtp" without "model"
    drafts with the layer."""
    folder = tmp_path / "with-mtp"
    folder.mkdir()
    for file in tiny_model_dir.iterdir():  # the model's files, not the heads saved beside them
        if file.is_file():
            shutil.copy(file, folder)
    config = json.loads((folder / "config.json").read_text())
    if config["model_type"] == "qwen2":
        config |= {"model_type": "mimo", "architectures": ["MiMoForCausalLM"]}
        (folder / "config.json").write_text(json.dumps(config))
    layer = build_tiny_mtp(tiny_model_dir, tmp_path / "layer", "mimo")
    shutil.copy(layer / "model.safetensors", folder / "model-mtp.safetensors")
    llm = _mtp(folder, None)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    assert sum(o.metrics.spec.num_draft_tokens for o in outs) > 0
    assert llm.engine.drafter.head.layout.name == "mimo"


def test_a_folder_without_an_mtp_layer_or_of_another_model_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(UserError, match=r"holds no MTP layer: none of model\.layers\.3\.eh_proj"):
        _mtp(tiny_model_dir, tiny_model_dir)
    other = build_tiny_model(tmp_path / "wide", "llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(
        UserError, match=r"belongs to another model: .*hidden_size 32 \(target 64\)"
    ):
        _mtp(tiny_model_dir, build_tiny_mtp(other, tmp_path / "wide-mtp"))
    layer = build_tiny_mtp(tiny_model_dir, tmp_path / "cut")
    with safe_open(str(layer / "model.safetensors"), framework="pt") as f:
        kept = {n: f.get_tensor(n) for n in f.keys() if "mlp.down_proj" not in n}  # noqa: SIM118
    save_file(kept, str(layer / "model.safetensors"))
    with pytest.raises(UserError, match=r"deepseek_v3 MTP layer lacks 1 tensor.*down_proj"):
        _mtp(tiny_model_dir, layer)
    with pytest.raises(UserError, match="'model' must be a folder's path"):
        _mtp(tiny_model_dir, None, model="")


def test_the_trainable_layer_equals_the_inference_layer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """TTT step j of `train --method mtp`'s module gives, for the last committed entry, the
    logits (over the draft vocabulary) the drafter computes for its (j + 1)-th token, once
    saved and loaded as a DeepSeek-V3-named layer (fp32)."""
    target = load_model(tiny_model_dir, dtype="float32")
    cfg = target.config
    ids = torch.arange(0, cfg.vocab_size, 3)  # a draft vocabulary of every third token
    rows, norm = target_output(tiny_model_dir, ids)
    weights = initial_mtp_weights(cfg, tiny_model_dir, ids, "target", 0, norm)
    trainable = TrainableMtp(
        cfg, weights, target.embed_tokens.weight, rows, target_config_json(tiny_model_dir)
    )
    with torch.no_grad():  # not the saved form's starting point: train-like weights
        for param in trainable.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    trainable.save(tmp_path / "layer", trainable.head_weights(), {"steps": 0})
    head = load_mtp_head(tmp_path / "layer", target, None)
    assert head.layout.name == "deepseek_v3" and head.own_head is None
    tokens = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.prefill([20], "cpu")
    _, states = target(tokens, meta, target.new_cache(1, 20), hidden_layers=(cfg.num_layers,))
    with torch.no_grad():
        steps = [trainable.logits(h) for h in trainable(states, tokens, 3)]
    n = 12  # committed entries 0..11
    cache = head.new_cache(1, 32)
    logits, out = head(
        tokens[:, 1 : n + 1], states[:, :n], AttentionMetadata.prefill([n], "cpu"), cache
    )
    torch.testing.assert_close(logits[0][:, ids], steps[0][0, :n], atol=1e-5, rtol=1e-5)
    out = out[:, -1:]
    for j in (1, 2):
        meta = AttentionMetadata.contiguous(AttentionMode.DECODE, [n + j - 1], [1], "cpu")
        logits, out = head(tokens[:, n + j : n + j + 1], out, meta, cache)
        torch.testing.assert_close(logits[0, 0, ids], steps[j][0, n - 1], atol=1e-5, rtol=1e-5)


def test_training_a_layer_helps_and_it_drafts_losslessly(tmp_path: Path) -> None:
    """`train --method mtp` on a tiny Llama: the loss falls and agreement rises, and the saved
    folder drafts through method "mtp" with output equal to plain decoding, its drafts
    accepted far more often than its starting point's."""
    model_dir = build_tiny_model(tmp_path / "target", "llama")
    out = tmp_path / "layer"
    train(
        train_config(model_dir, out, method="mtp"), examples(200), examples(4, 1000), progress=False
    )
    log = json.loads((out / "train_log.json").read_text())
    first, last = log["history"][0], log["history"][-1]
    assert last["loss"] < first["loss"] - 0.3 and last["agree_0"] > first["agree_0"]
    prompts = chat_prompts(model_dir, examples(6, 2000))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(model_dir), dtype="float32").generate(prompts, params)]
    untrained = tmp_path / "untrained"  # its starting point ("random"), saved the same way
    cfg = ModelConfig.from_folder(model_dir)
    ids = torch.arange(cfg.vocab_size)
    rows, norm = target_output(model_dir, ids)
    start = TrainableMtp(
        cfg,
        initial_mtp_weights(cfg, model_dir, ids, "random", 0, norm),
        torch.zeros(cfg.vocab_size, cfg.hidden_size),  # the embedding: read in training only
        rows,
        target_config_json(model_dir),
    )
    start.save(untrained, start.head_weights(), {})
    llms = [_mtp(model_dir, layer) for layer in (untrained, out)]
    rates = acceptance_rates(llms, prompts, params, plain)
    print(
        f"loss {first['loss']:.3f} -> {last['loss']:.3f}, agree_0 {first['agree_0']:.3f} -> "
        f"{last['agree_0']:.3f}, acceptance {rates}"
    )
    assert rates[1] > rates[0] + 0.1, rates


def test_plan_prices_an_mtp_layer(tiny_model_dir: Path, tiny_prompts: Path) -> None:
    """`specdecode plan` replays the layer's chains and trees on the target's greedy text,
    its drafting time measured, and picks the best."""
    layer = build_tiny_mtp(tiny_model_dir, tiny_model_dir / "mtp-deepseek_v3", "deepseek_v3")
    check_plan_prices(
        tiny_model_dir,
        tiny_prompts,
        {"method": "mtp", "model": str(layer), "num_speculative_tokens": 2},
        2,
    )
