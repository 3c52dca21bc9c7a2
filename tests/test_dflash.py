"""Block drafting with DFlash drafters (method "dflash"): the drafter computes what the
published equations give, drafting is lossless (chains, trees, sampling, batched and alone)
with one block pass a step, the trainable drafter equals the loaded one, training helps, and
bad folders and shapes are clear errors.

No DFlash drafter installs here (the released ones are for 4B-8B targets): the tiny random
models get one written in z-lab's format (`conftest.build_tiny_dflash`). The reference below
is written from z-lab's dflash model code (`DFlashDraftModel.forward`, its attention over
[context, block] keys without a mask, `extract_context_feature`'s hidden_states index
`layer_id + 1`), over Hugging Face's target model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_dflash, build_tiny_model
from head_cases import (
    acceptance_rates,
    check_certify,
    check_greedy_and_sampled_in_one_batch,
    check_greedy_equals_plain,
    check_plan_prices,
    edited_head,
    passes_per_propose,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from spec_cases import GREEDY, PROMPTS, FakeSeq
from train_cases import chat_prompts, examples, train_config

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.drafters import dflash as dflash_drafter
from specdecode.drafters.dflash import DFlashDrafter
from specdecode.errors import UserError
from specdecode.heads.dflash import BlockInput, load_dflash_head
from specdecode.heads.dflash_config import DFlashHeadConfig
from specdecode.llm import LLM
from specdecode.model.config import ModelConfig
from specdecode.model.loading import load_model
from specdecode.sampling_params import SamplingParams
from specdecode.train.dflash_model import TrainableDFlash, initial_dflash_weights
from specdecode.train.init import target_output
from specdecode.train.trainer import train
from specdecode.types import DraftBudget, TargetFeatures, TargetOutputs, Verdict

K = 4  # the tiny drafters' block: an anchor and 4 mask entries


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x ([heads, T, D]) at positions ([T])."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = (positions.double()[:, None] * inv[None]).float()
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = dim // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Reference:
    """A DFlash drafter computed from scratch by the published equations (fp32, no cache),
    the context features taken from Hugging Face's hidden_states."""

    def __init__(self, model_dir: Path, drafter_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.cfg = json.loads((drafter_dir / "config.json").read_text())
        with safe_open(str(drafter_dir / "model.safetensors"), framework="pt") as f:
            self.w = {n: f.get_tensor(n).float() for n in f.keys()}  # noqa: SIM118

    @torch.no_grad()
    def features(self, ids: list[int]) -> torch.Tensor:
        """The concatenated hidden_states[layer_id + 1] after each token ([n, len * h])."""
        out = self.target(torch.tensor([ids]), output_hidden_states=True)
        layers = self.cfg["dflash_config"]["target_layer_ids"]
        return torch.cat([out.hidden_states[i + 1][0] for i in layers], dim=-1)

    @torch.no_grad()
    def block_logits(self, ids: list[int], drafts: int) -> torch.Tensor:
        """Logits of the block after committed `ids` (context: the states of all but the
        last; anchor: the last) -> [drafts, V]."""
        cfg, w, eps = self.cfg, self.w, self.cfg["rms_norm_eps"]
        heads, kv, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        theta = cfg["rope_theta"]
        context = _rms(self.features(ids)[:-1] @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        a = len(ids) - 1
        embed = self.target.get_input_embeddings().weight
        mask = w.get("mask_embed")
        if mask is None:
            mask = embed[cfg["dflash_config"]["mask_token_id"]]
        x = torch.cat([embed[ids[-1]][None], mask.expand(drafts, -1)])  # [1 + drafts, h]
        if cfg["dflash_config"].get("block_inputs") == "anchored":
            x[1:] += embed[ids[-1]]  # mask entries: plus the anchor's embedding
            x += self.features(ids)[-2] @ w["fc.weight"].T  # all: plus fc(the newest states)
        ctx_pos, blk_pos = torch.arange(a), torch.arange(a, a + 1 + drafts)
        for i in range(cfg["num_hidden_layers"]):
            at = f"layers.{i}."

            def proj(x: torch.Tensor, name: str, at: str = at) -> torch.Tensor:
                bias = w.get(f"{at}self_attn.{name}_proj.bias")
                out = x @ w[f"{at}self_attn.{name}_proj.weight"].T
                return out if bias is None else out + bias

            h = _rms(x, w[f"{at}input_layernorm.weight"], eps)
            q = _rms(proj(h, "q").view(-1, heads, dim), w[f"{at}self_attn.q_norm.weight"], eps)
            ks = [
                _rms(proj(src, "k").view(-1, kv, dim), w[f"{at}self_attn.k_norm.weight"], eps)
                for src in (context, h)
            ]
            q = _rope(q.transpose(0, 1), blk_pos, theta)  # [H, T, D]
            k = torch.cat(
                [
                    _rope(ks[0].transpose(0, 1), ctx_pos, theta),
                    _rope(ks[1].transpose(0, 1), blk_pos, theta),
                ],
                dim=1,
            )  # [Hkv, a + T, D]
            v = torch.cat([proj(context, "v"), proj(h, "v")]).view(-1, kv, dim).transpose(0, 1)
            k, v = (t.repeat_interleave(heads // kv, dim=0) for t in (k, v))
            probs = ((q @ k.transpose(-1, -2)) / math.sqrt(dim)).softmax(-1)  # no mask
            attn = (probs @ v).transpose(0, 1).reshape(len(x), heads * dim)
            x = x + proj(attn, "o")
            y = _rms(x, w[f"{at}post_attention_layernorm.weight"], eps)
            gate, up = y @ w[f"{at}mlp.gate_proj.weight"].T, y @ w[f"{at}mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[f"{at}mlp.down_proj.weight"].T
        head = self.target.get_output_embeddings().weight
        return _rms(x[1:], w["norm.weight"], eps) @ head.T


@pytest.fixture(scope="module", params=["learned-mask", "mask-token", "anchored"])
def drafter_dir(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Path:
    """z-lab's forms (a learned mask embedding or a mask token's) and ours (anchored)."""
    mask = 7 if request.param == "mask-token" else None
    inputs = "anchored" if request.param == "anchored" else "embeddings"
    return build_tiny_dflash(
        tiny_model_dir,
        tiny_model_dir / f"dflash-{request.param}",
        mask_token=mask,
        block_inputs=inputs,
    )


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[list[int]]:
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    return [list(o.token_ids) for o in plain.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama and a drafter `train --method dflash` trained for it."""
    root = tmp_path_factory.mktemp("dflash-train")
    model_dir = build_tiny_model(root / "target", "llama")
    out = root / "drafter"
    config = train_config(model_dir, out, method="dflash", unroll=K, draft_layers=2)
    train(config, examples(200), examples(4, 1000), progress=False)
    return model_dir, out


def _dflash(model_dir: Path, drafter_dir: Path, **spec: object) -> LLM:
    config = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": 3}
    return LLM(str(model_dir), dtype="float32", speculative_config={**config, **spec})


def test_the_drafter_computes_what_the_published_equations_give(
    tiny_model_dir: Path, drafter_dir: Path
) -> None:
    """Block logits of our drafter (its context grown step by step, the target's states as
    our model gives them for its `feature_layers`) equal the reference's from scratch; a
    drafter asked for fewer tokens than its block drafts still runs the whole block (its q
    are the whole block's first levels)."""
    ref = Reference(tiny_model_dir, drafter_dir)
    target = load_model(tiny_model_dir, "float32")
    head = load_dflash_head(drafter_dir, target, None)
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    # (drafter, the tokens it is asked for, its requests' parameters)
    drafters = [(DFlashDrafter(head, K), K, greedy), (DFlashDrafter(head, K), K, sampled)]
    drafters.append((DFlashDrafter(head, 2), 2, sampled))
    ids = [5, 17, 42, 99, 3, 250, 8, 61, 77, 12, 140, 33]
    tokens = torch.tensor([ids])
    meta = AttentionMetadata.prefill([len(ids)], "cpu")
    _, ours = target(tokens, meta, target.new_cache(1, len(ids)), hidden_layers=head.feature_layers)
    torch.testing.assert_close(ours[0], ref.features(ids), rtol=1e-4, atol=1e-4)
    fed = 0
    for end in (3, 4, 8, 12):  # steps that keep 3, 1 and 4 states
        want = ref.block_logits(ids[:end], K)  # [K, V]
        for drafter, k, params in drafters:
            seq = FakeSeq("s", ids[:end], params=params, generator=torch.Generator())
            states = TargetFeatures(fed, ours[0, fed : end - 1])
            drafter.commit(seq, Verdict(0, tokens[0, end - 1 : end]), TargetOutputs(hidden=states))
            draft = drafter.propose([seq], [DraftBudget(K)])[0]
            if params.greedy:
                assert draft.tokens.tolist() == want.argmax(-1).tolist()
            else:  # q of the first k levels of the whole block
                torch.testing.assert_close(draft.probs, want[:k].softmax(-1), rtol=1e-4, atol=1e-6)
        fed = end - 1


def test_near_the_context_end_the_block_has_the_positions_left(
    tiny_model_dir: Path, drafter_dir: Path
) -> None:
    """Two positions before the drafter's context ends, a draft of up to K tokens is the 2
    levels of a block of 2 mask entries (the reference's, from scratch)."""
    ref = Reference(tiny_model_dir, drafter_dir)
    target = load_model(tiny_model_dir, "float32")
    head = load_dflash_head(drafter_dir, target, None)
    drafter = DFlashDrafter(head, K)
    ids = torch.randint(0, 200, (head.rotary.cos.shape[0] - 2,), generator=torch.Generator())
    ids = ids.tolist()
    meta = AttentionMetadata.prefill([len(ids)], "cpu")
    cache = target.new_cache(1, len(ids))
    _, ours = target(torch.tensor([ids]), meta, cache, hidden_layers=head.feature_layers)
    seq = FakeSeq("s", ids, params=SamplingParams(temperature=0.0))
    hidden = TargetFeatures(0, ours[0, :-1])
    drafter.commit(seq, Verdict(0, torch.tensor(ids[-1:])), TargetOutputs(hidden=hidden))
    draft = drafter.propose([seq], [DraftBudget(K)])[0]
    assert draft.tokens.tolist() == ref.block_logits(ids, 2).argmax(-1).tolist()


def test_the_native_block_pass_gives_the_torch_routes_bits(
    tiny_model_dir: Path, drafter_dir: Path
) -> None:
    """In bf16 (and int8) each drafter layer runs as one native call over the block (a TREE
    pass whose entries see each other); it gives the bits of the torch route."""
    target = load_model(tiny_model_dir, "bfloat16", quantization="int8")
    head = load_dflash_head(drafter_dir, target, "int8")
    assert all(layer.native is not None for layer in head.layers)
    features = torch.randn(9, len(head.feature_layers) * target.config.hidden_size)
    logits = []
    for native in (True, False):
        if not native:
            for layer in head.layers:
                layer.native = None
        cache = head.new_cache(1, 16)
        head.extend(cache, [features[:5]])
        newest = head.extend(cache, [features[5:]])[0]  # two steps' states
        logits.append(head.logits(head.blocks(cache, [BlockInput(17, K, newest)])[0]))
        assert cache.lengths == [9]  # the block's own entries dropped
    assert torch.equal(logits[0], logits[1])


def test_greedy_equals_plain_with_native_layers(tiny_model_dir: Path, drafter_dir: Path) -> None:
    """bf16 activations, int8 projections: the drafter's layers run natively; output ==
    plain decoding's in the same format."""
    plain = LLM(str(tiny_model_dir), dtype="bfloat16", quantization="int8")
    want = [list(o.token_ids) for o in plain.generate(PROMPTS, GREEDY)]
    config = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": K}
    llm = LLM(str(tiny_model_dir), dtype="bfloat16", quantization="int8", speculative_config=config)
    assert llm.engine.drafter.head.layers[0].native is not None
    check_greedy_equals_plain(llm, want)


@pytest.mark.parametrize(
    "spec",
    [
        {"num_speculative_tokens": 1},
        {"num_speculative_tokens": K},
        {"num_speculative_tokens": 6, "tree_width": 2, "tree_depth": 3},
    ],
    ids=["k1", "block", "tree"],
)
def test_greedy_equals_plain_batched_and_alone_with_one_block_pass_a_step(
    tiny_model_dir: Path, drafter_dir: Path, expected: list[list[int]], spec: dict
) -> None:
    llm = _dflash(tiny_model_dir, drafter_dir, **spec)
    drafter = llm.engine.drafter
    counts = [passes_per_propose(drafter, name) for name in ("extend", "blocks", "logits")]
    check_greedy_equals_plain(llm, expected)
    assert not len(drafter._contexts)  # finished requests left their rows
    # per step, however many sequences draft, however long a chain or deep a tree: one pass
    # feeding their contexts, one over their blocks, one of the output rows (batches of two
    # and more ran)
    for per_propose in counts:
        assert all(n <= 1 for n, _ in per_propose)
        assert any(n and drafting > 1 for n, drafting in per_propose)


def test_a_batchs_drafts_are_each_sequences_own(tiny_model_dir: Path, drafter_dir: Path) -> None:
    """Sequences drafted together (their contexts fed in one pass, their blocks in one pass
    with the shorter ones padded, their outputs scored in one; int8: row-exact) draft what
    each drafts alone, q bit for bit, over two steps: in the first one sequence drafts
    nothing and one at most 2 tokens; the last sits 3, then 2 positions before the
    context's end."""
    target = load_model(tiny_model_dir, "bfloat16", quantization="int8")
    head = load_dflash_head(drafter_dir, target, "int8")
    end = head.positions
    features = torch.randn(end, len(head.feature_layers) * target.config.hidden_size)
    lengths = [7, 10, 13, end - 3]
    drafts, sampled = [], SamplingParams(temperature=1.0)

    def gen(i: int) -> torch.Generator:
        return torch.Generator().manual_seed(i)

    for together in (True, False):
        drafter = DFlashDrafter(head, K)
        for step in range(2):
            seqs = [
                FakeSeq(f"s{i}", list(range(n + step)), params=sampled, generator=gen(i))
                for i, n in enumerate(lengths)
            ]
            for seq in seqs:
                fed = 0 if step == 0 else len(seq.token_ids) - 2
                hidden = TargetFeatures(fed, features[fed : len(seq.token_ids) - 1])
                drafter.commit(
                    seq, Verdict(0, torch.tensor([seq.token_ids[-1]])), TargetOutputs(hidden)
                )
            budgets = [DraftBudget(n) for n in ([K, 0, 2, K] if step == 0 else [K] * 4)]
            if together:
                drafts.append(drafter.propose(seqs, budgets))
            else:
                drafts.append(
                    [drafter.propose([s], [b])[0] for s, b in zip(seqs, budgets, strict=True)]
                )
    for together, alone in zip(drafts[:2], drafts[2:], strict=True):
        assert all(torch.equal(a.probs, b.probs) for a, b in zip(together, alone, strict=True))
        assert [d.tokens.tolist() for d in together] == [d.tokens.tolist() for d in alone]
    assert [[len(d.tokens) for d in step] for step in drafts[:2]] == [[K, 0, 2, 3], [K, K, K, 2]]


def test_a_draft_vocabulary_cut_at_load_scores_those_rows_and_drafts_only_them(
    tiny_model_dir: Path, drafter_dir: Path, expected: list[list[int]], monkeypatch
) -> None:
    """`draft_vocab_size` on a folder without a draft vocabulary (z-lab's): the drafter
    scores the target's rows of the most frequent tokens only (their logits are the whole
    head's at those ids), drafts only them, and output equals plain decoding."""
    target = load_model(tiny_model_dir, "float32")
    ids = torch.arange(1, target.config.vocab_size, 2)  # stands in for the frequency table
    monkeypatch.setattr(dflash_drafter, "frequent_tokens", lambda _tok, size, _v: ids[:size])
    whole, cut = (load_dflash_head(drafter_dir, target, None, v) for v in (None, ids))
    assert cut.draft_to_target.tolist() == ids.tolist()
    features = torch.randn(6, len(whole.feature_layers) * target.config.hidden_size)
    logits = []
    for head in (whole, cut):
        cache = head.new_cache(1, 16)
        newest = head.extend(cache, [features])[0]
        logits.append(head.logits(head.blocks(cache, [BlockInput(17, K, newest)])[0]))
    torch.testing.assert_close(logits[1], logits[0][:, ids])
    llm = _dflash(tiny_model_dir, drafter_dir, draft_vocab_size=len(ids))
    drafted: list[int] = []
    propose = llm.engine.drafter.propose

    def recording(seqs: object, budgets: object) -> object:
        drafts = propose(seqs, budgets)
        drafted.extend(t for d in drafts for t in d.tokens.tolist())
        return drafts

    llm.engine.drafter.propose = recording
    check_greedy_equals_plain(llm, expected)
    assert drafted and set(drafted) <= set(ids.tolist())


def test_a_draft_vocabulary_is_refused_where_the_folder_has_one(
    trained: tuple[Path, Path], tiny_model_dir: Path, drafter_dir: Path
) -> None:
    model_dir, folder = trained
    with pytest.raises(UserError, match="has a draft vocabulary of its own"):
        _dflash(model_dir, folder, draft_vocab_size=100)
    for bad in (0, 1.5):
        with pytest.raises(UserError, match="draft_vocab_size must be None"):
            _dflash(tiny_model_dir, drafter_dir, draft_vocab_size=bad)
    with pytest.raises(
        UserError, match=r"draft_vocab_size must be in 1\.\.\d+ \(the target's vocabulary\)"
    ):
        _dflash(tiny_model_dir, drafter_dir, draft_vocab_size=10**6)


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ("repeated", r"its d2t .*the kept tokens must be .* sorted, distinct"),
        ("past-the-vocabulary", r"d2t maps draft tokens outside the target's vocabulary"),
    ],
)
def test_a_folders_bad_draft_vocabulary_is_refused_naming_it(
    trained: tuple[Path, Path], tmp_path: Path, fault: str, says: str
) -> None:
    """A saved d2t (target id = draft row + d2t[row]) whose ids repeat or leave the target's
    vocabulary is refused at load with the folder named, not met as a wrong or failing row."""
    model_dir, folder = trained
    bad = edited_head(folder, tmp_path, lambda cfg: None)
    weights = load_file(str(bad / "model.safetensors"))
    d2t, vocab = weights["d2t"], ModelConfig.from_folder(model_dir).vocab_size
    if fault == "repeated":
        d2t[1] = d2t[0] - 1  # row 1 -> row 0's target id
    else:
        d2t[-1] = vocab  # the last row -> beyond the vocabulary
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(UserError, match=f"edited: {says}"):
        _dflash(model_dir, bad)


def test_greedy_chains_come_as_tokens_and_sampled_ones_with_their_q(
    tiny_model_dir: Path, drafter_dir: Path, expected: list[list[int]]
) -> None:
    llm = _dflash(tiny_model_dir, drafter_dir)
    check_greedy_and_sampled_in_one_batch(llm, llm.engine.drafter.vocab_size, GREEDY, expected[0])


@pytest.mark.parametrize("biased", [False, True])
def test_sampling_matches_the_target_and_a_biased_verifier_fails(
    trained: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, biased: bool
) -> None:
    """`certify`'s chi-square test over whole continuations (q per block entry, over the
    whole vocabulary; a trained drafter, whose q resembles p without being it): exact; a
    verifier treating q as one-hot fails it."""
    model_dir, folder = trained
    llm = _dflash(model_dir, folder, num_speculative_tokens=2)
    check_certify(llm, model_dir, monkeypatch, biased)


def _dir(path: Path) -> Path:
    path.mkdir()
    return path


def test_bad_folders_and_shapes_are_clear_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = build_tiny_dflash(tiny_model_dir, tiny_model_dir / "dflash-learned-mask")
    with pytest.raises(UserError, match=r"block drafts at most 4 tokens \(block_size 5\)"):
        _dflash(tiny_model_dir, folder, num_speculative_tokens=5)
    with pytest.raises(UserError, match="tree_depth 5 is too deep"):
        _dflash(tiny_model_dir, folder, num_speculative_tokens=8, tree_width=2, tree_depth=5)

    def dflash2(cfg: dict) -> None:
        cfg["architectures"] = ["DFlash2DraftModel"]

    with pytest.raises(UserError, match="is a DFlash2DraftModel, not a DFlashDraftModel"):
        _dflash(tiny_model_dir, edited_head(folder, _dir(tmp_path / "a"), dflash2))

    def causal(cfg: dict) -> None:
        cfg["dflash_config"]["is_causal"] = True

    with pytest.raises(UserError, match="causal DFlash layers are not supported"):
        _dflash(tiny_model_dir, edited_head(folder, _dir(tmp_path / "b"), causal))

    def no_layers(cfg: dict) -> None:
        del cfg["dflash_config"]["target_layer_ids"]

    with pytest.raises(UserError, match=r"lacks dflash_config\.target_layer_ids"):
        _dflash(tiny_model_dir, edited_head(folder, _dir(tmp_path / "c"), no_layers))
    other = build_tiny_model(tmp_path / "deep", "llama", num_hidden_layers=5)
    with pytest.raises(
        UserError, match=r"made for another target: num_target_layers 3 \(target 5\)"
    ):
        _dflash(other, folder)
    with pytest.raises(Exception, match="no such DFlash head folder"):
        _dflash(tiny_model_dir, tmp_path / "missing")


def _trainable(
    model_dir: Path, draft_ids: torch.Tensor, init: str = "target", inputs: str = "anchored"
) -> TrainableDFlash:
    """A trainable two-layer drafter (block of K, its blocks starting from `inputs`) for the
    tiny target, started as `init` says."""
    cfg_target = ModelConfig.from_folder(model_dir)
    target = load_model(model_dir, dtype="float32")
    cfg = DFlashHeadConfig.for_target(
        cfg_target, 2, K + 1, (1, 2, 3), len(draft_ids), block_inputs=inputs
    )
    rows, norm = target_output(model_dir, draft_ids)
    embed = target.embed_tokens.weight
    weights = initial_dflash_weights(cfg, cfg_target, model_dir, draft_ids, init, 0, norm, embed)
    return TrainableDFlash(cfg, weights, embed, rows)


@pytest.mark.parametrize("inputs", ["anchored", "embeddings"])
def test_the_trainable_drafter_scores_what_one_block_pass_drafts(
    tiny_model_dir: Path, tmp_path: Path, inputs: str
) -> None:
    """Output j of the training module's block at column t (packed sequences, blocks at
    chosen columns) gives the logits (over the draft vocabulary) of the loaded drafter's
    mask entry j + 1 after committed tokens ..t + 1 (fp32)."""
    target = load_model(tiny_model_dir, dtype="float32")
    ids = torch.arange(0, target.config.vocab_size, 3)  # a draft vocabulary of every third token
    trainable = _trainable(tiny_model_dir, ids, inputs=inputs)
    with torch.no_grad():  # not the saved form's starting point: train-like weights
        for param in trainable.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    trainable.save(tmp_path / "drafter", trainable.head_weights(), {"steps": 0})
    head = load_dflash_head(tmp_path / "drafter", target, None)
    assert head.draft_to_target.tolist() == ids.tolist()  # it drafts over what it trained on
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(0, target.config.vocab_size, (14,), generator=gen)
    second = torch.randint(0, target.config.vocab_size, (10,), generator=gen)
    states = []
    for seq in (first, second):  # each sequence's states from its own pass
        meta = AttentionMetadata.prefill([len(seq)], "cpu")
        cache = target.new_cache(1, len(seq))
        states.append(target(seq[None], meta, cache, hidden_layers=head.feature_layers)[1][0])
    tokens = torch.cat([first, second])[None]  # one packed row: 14 + 10 tokens
    features = torch.cat(states)[None]
    starts = torch.tensor([[0] * 14 + [14] * 10])
    columns = torch.tensor([[3, 8, 16, 19]])  # two blocks in each sequence
    with torch.no_grad():
        outputs = trainable(features, tokens, K, starts, columns)
        logits = [trainable.logits(h)[0] for h in outputs]  # K x [4, Vd]
    for a, column in enumerate(columns[0].tolist()):
        begin = 0 if column < 14 else 14
        cache = head.new_cache(1, column + 1 - begin + K)
        newest = head.extend(cache, [features[0, begin : column + 1]])[0]
        states = head.blocks(cache, [BlockInput(int(tokens[0, column + 1]), K, newest)])[0]
        got = head.logits(states)  # [K, Vd]: over the saved d2t's tokens
        want = torch.stack([logits[j][a] for j in range(K)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_training_a_drafter_helps_and_it_drafts_losslessly(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    """`train --method dflash`: the loss falls and agreement rises, and the saved folder
    drafts through method "dflash" with output equal to plain decoding, its drafts accepted
    far more often than its random starting point's."""
    model_dir, out = trained
    log = json.loads((out / "train_log.json").read_text())
    first, last = log["history"][0], log["history"][-1]
    assert last["loss"] < first["loss"] - 0.3 and last["agree_0"] > first["agree_0"]
    prompts = chat_prompts(model_dir, examples(6, 2000))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(model_dir), dtype="float32").generate(prompts, params)]
    untrained = tmp_path / "untrained"
    vocab = ModelConfig.from_folder(model_dir).vocab_size
    start = _trainable(model_dir, torch.arange(vocab), init="random")
    start.save(untrained, start.head_weights(), {})
    llms = [_dflash(model_dir, folder, num_speculative_tokens=K) for folder in (untrained, out)]
    rates = acceptance_rates(llms, prompts, params, plain)
    print(
        f"loss {first['loss']:.3f} -> {last['loss']:.3f}, agree_0 {first['agree_0']:.3f} -> "
        f"{last['agree_0']:.3f}, acceptance {rates}"
    )
    assert rates[1] > rates[0] + 0.1, rates


def test_plan_prices_a_dflash_drafter(tiny_model_dir: Path, tiny_prompts: Path) -> None:
    """`specdecode plan` replays the drafter's chains and trees on the target's greedy text
    (with the target's states of that text), its drafting time measured, and picks the best."""
    folder = build_tiny_dflash(tiny_model_dir, tiny_model_dir / "dflash-learned-mask")
    check_plan_prices(
        tiny_model_dir,
        tiny_prompts,
        {"method": "dflash", "model": str(folder), "num_speculative_tokens": 2},
        3,
    )
