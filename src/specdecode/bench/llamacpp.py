"""The llama.cpp peer (`llama-cpp-python`): plain decoding and its prompt-lookup drafting.

It runs the GGUF file that our model folder was converted from, so llama.cpp computes with the
file's own quantized weights (for example Q4_K_M) while we compute with bf16 weights dequantized
from them: tokens/s compare the two engines on the same file; greedy outputs may differ.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from specdecode.bench.methods import MethodSpec
from specdecode.bench.records import Timing
from specdecode.errors import MissingDependencyError, ModelNotFoundError
from specdecode.sampling_params import SamplingParams

LLAMACPP_REQUIREMENT = "llama-cpp-python==0.3.36"


def gguf_of(model: str, folder: Path) -> Path:
    """The GGUF file behind `model`: the file itself, or `model.gguf` in a pulled alias' folder."""
    given = Path(model).expanduser()
    if given.suffix.lower() == ".gguf" and given.is_file():
        return given
    path = folder / "model.gguf"
    if path.is_file():
        return path
    raise ModelNotFoundError(
        f"the llamacpp methods need the model's GGUF file, and {folder} has no model.gguf; "
        "pass a model alias or a .gguf file as --model"
    )


class LlamaCppRunner:
    """One llama.cpp model (its own context and KV cache) per method.

    llamacpp-lookup uses `LlamaPromptLookupDecoding(num_pred_tokens=K, max_ngram_size=max)`
    (default max 2, llama-cpp-python's default), which needs `logits_all=True`.
    """

    def __init__(
        self, spec: MethodSpec, model: str, folder: Path, n_ctx: int, eos: list[int]
    ) -> None:
        """Load the GGUF behind `model` (see `gguf_of`) with room for `n_ctx` tokens."""
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ModuleNotFoundError as err:
            raise MissingDependencyError(
                f"the llamacpp* methods need llama-cpp-python: pip install {LLAMACPP_REQUIREMENT} "
                "(it builds llama.cpp from source, about 7 minutes on 2 cores)"
            ) from err
        gguf = gguf_of(model, folder)
        draft = None
        if spec.kind == "llamacpp-lookup":
            draft = LlamaPromptLookupDecoding(
                num_pred_tokens=spec.options["k"], max_ngram_size=spec.option("max")
            )
        threads = torch.get_num_threads()  # the same threads as ours
        self.spec = spec
        self.eos = set(eos)
        self.model = Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=draft is not None,
            draft_model=draft,
            verbose=False,
        )

    def run(self, ids: list[int], params: SamplingParams) -> Timing:
        """One request from an empty cache (no prefix reuse between runs), an arrival per
        token."""
        self.model.reset()  # forget the previous request, so its prefix is not reused
        if params.seed is not None:
            self.model.set_seed(params.seed)
        top_k = params.top_k if params.top_k > 0 else 0
        new: list[int] = []
        stamps: list[tuple[float, int]] = []
        t0 = time.perf_counter()
        for token in self.model.generate(
            ids, temp=params.temperature, top_k=top_k, top_p=params.top_p, min_p=0.0, reset=True
        ):
            new.append(int(token))
            stamps.append((time.perf_counter(), len(new)))
            if (int(token) in self.eos and not params.ignore_eos) or len(new) >= params.max_tokens:
                break
        return Timing.measured(t0, time.perf_counter(), stamps, new)
