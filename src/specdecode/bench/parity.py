"""Parity with llama.cpp on one GGUF file: teacher-forced next-token argmax agreement.

Both engines read the same token ids in one prefill each; at every position we compare the
argmax of our logits with llama.cpp's. With quantization="gguf" both compute with the file's
own blocks, so only the engines' arithmetic differs (activation rounding, summation order).
`exact_model` is the yardstick for both: the file's weights in fp32 with fp32 activations.
`benchmarks/gguf_parity.py` runs it over the bench's prompt sets; a test runs it on SmolLM2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.errors import MissingDependencyError
from specdecode.model.config import ModelConfig
from specdecode.model.gguf_linear import GgufWeight, read_gguf_weights
from specdecode.model.transformer import Transformer


def llamacpp_logits(gguf: Path, sequences: list[list[int]]) -> list[np.ndarray]:
    """llama.cpp's logits ([len, V] fp32) at every position of each token sequence, from one
    prefill each (fresh cache)."""
    try:
        from llama_cpp import Llama
    except ModuleNotFoundError as err:
        raise MissingDependencyError(
            "parity with llama.cpp needs llama-cpp-python: pip install llama-cpp-python==0.3.36"
        ) from err
    threads = torch.get_num_threads()
    longest = max(len(ids) for ids in sequences)
    model = Llama(
        model_path=str(gguf),
        n_ctx=longest,
        n_batch=longest,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        verbose=False,
    )
    out = []
    for ids in sequences:
        model.reset()
        model.eval(ids)
        out.append(np.array(model.scores[: len(ids)], dtype=np.float32))
    return out


def exact_model(gguf: Path, cfg: ModelConfig) -> Transformer:
    """The model a GGUF file stands for without activation rounding: every weight dequantized
    exactly to fp32, fp32 activations. Both engines' gguf results are approximations of it."""
    weights = read_gguf_weights(gguf, cfg)
    dense = {n: w.dense() if isinstance(w, GgufWeight) else w for n, w in weights.items()}
    return Transformer(cfg, dense, None).eval()


@torch.inference_mode()
def our_logits(model: Transformer, sequences: list[list[int]]) -> list[np.ndarray]:
    """Our logits ([len, V] fp32) at every position of each sequence, one prefill each."""
    out = []
    for ids in sequences:
        meta = AttentionMetadata.prefill([len(ids)], model.device)
        logits, _ = model(torch.tensor([ids]), meta, model.new_cache(1, len(ids)))
        out.append(logits[0].float().numpy())
    return out


def argmax_agreement(ours: list[np.ndarray], theirs: list[np.ndarray]) -> tuple[int, int]:
    """(positions whose argmax agrees, positions) over all sequences."""
    agree = sum(
        int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ours, theirs, strict=True)
    )
    return agree, sum(len(a) for a in ours)
