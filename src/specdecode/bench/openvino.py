"""The OpenVINO GenAI peer (`openvino-genai`): plain decoding, its draft-model speculative
decoding and its prompt-lookup decoding, on the CPU.

OpenVINO runs its own IR, so the model folder (and a draft's) is exported once with
optimum-intel (`optimum-cli export openvino --weight-format int4|int8`, offline, from the
folder's safetensors) into `openvino-int4/` (or `-int8/`) beside the model, and reused after.
optimum-intel pulls its own torch and transformers, so it lives in a separate environment
(`make openvino-exporter` builds `.venv-optimum`); only the runtime (`openvino-genai`, no torch)
is needed where the bench runs. The peer gets our chat-templated prompt's token ids (not text),
so both engines see the same prompt, and OpenVINO's greedy output is compared with its own plain
run (`stats._plain_of`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdecode.bench.methods import MethodSpec
from specdecode.bench.records import Timing
from specdecode.errors import MissingDependencyError, UserError
from specdecode.model.registry import build_atomically
from specdecode.sampling_params import SamplingParams

OPENVINO_REQUIREMENT = "openvino-genai==2026.4.1.0"
# optimum-intel requires torchvision, whose PyPI build does not load with the local CPU torch;
# the text exporter does not use it, so the target removes it again.
EXPORTER_REQUIREMENT = '"optimum-intel[openvino]==2.2.0" torch==2.13.0'
EXPORTER_VENV = Path(".venv-optimum")  # what `make openvino-exporter` builds
CLI_VARIABLE = "SPECDECODE_OPTIMUM_CLI"


def optimum_cli() -> str:
    """The exporter: $SPECDECODE_OPTIMUM_CLI, else `optimum-cli` on PATH, else the one in
    `.venv-optimum/bin/` under the current folder; MissingDependencyError says how to get one."""
    given = os.environ.get(CLI_VARIABLE)
    if given:
        if not Path(given).is_file():
            raise UserError(f"${CLI_VARIABLE} is {given!r}, which is not a file")
        return given
    found = shutil.which("optimum-cli")
    if found:
        return found
    local = EXPORTER_VENV / "bin" / "optimum-cli"
    if local.is_file():
        return str(local)
    raise MissingDependencyError(
        "the openvino* methods export the model with optimum-intel's optimum-cli, which needs "
        f"its own torch and transformers: `make openvino-exporter` (a venv in {EXPORTER_VENV}/ "
        f"with pip install {EXPORTER_REQUIREMENT}), or set ${CLI_VARIABLE} to an optimum-cli"
    )


def export_command(cli: str, folder: Path, bits: int, out: Path) -> list[str]:
    """The optimum-cli call that exports the HF folder `folder` to OpenVINO IR in `out`, its
    linear weights compressed to `bits` (4: NNCF's int4 asymmetric, groups of 128, or smaller
    groups where 128 does not divide a layer's width, e.g. SmolLM2's 576; 8: int8 per channel)."""
    task = ["--task", "text-generation-with-past", "--weight-format", f"int{bits}"]
    groups = ["--group-size-fallback", "adjust"] if bits == 4 else []
    return [cli, "export", "openvino", "--model", str(folder), *task, *groups, str(out)]


def exported(folder: Path, bits: int, cli: str | None = None) -> Path:
    """`folder` exported to OpenVINO IR with `bits`-bit weights: `folder/openvino-int{bits}`,
    exported on first use (about a minute per billion parameters on 2 cores; offline) into a
    hidden sibling, moved in place only once complete (`build_atomically`). `cli`: the
    exporter (default `optimum_cli()`), asked for only when the export is missing."""
    out = folder / f"openvino-int{bits}"
    is_exported = (out / "openvino_model.xml").is_file
    if is_exported():
        return out
    cli = cli or optimum_cli()
    print(f"exporting {folder} to OpenVINO int{bits} with {cli} ...", file=sys.stderr)

    def build(staging: Path) -> None:
        offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        done = subprocess.run(
            export_command(cli, folder, bits, staging),
            env={**os.environ, **offline},
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0 or not (staging / "openvino_model.xml").is_file():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise UserError(
                f"optimum-cli could not export {folder} (exit {done.returncode}): {tail}"
            )

    build_atomically(out, build, f"optimum-cli export, int{bits}", ready=is_exported)
    return out


class _Arrivals:
    """Notes when new tokens arrive: OpenVINO's streamer gets one token per plain step and a
    list of tokens per speculative step. stamps: (`time.perf_counter()`, new tokens so far)."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, int]] = []
        self.count = 0

    def write(self, token: int | Sequence[int]) -> None:
        """One event of `token` (an id or a list of ids)."""
        self.count += 1 if isinstance(token, int) else len(token)
        self.stamps.append((time.perf_counter(), self.count))


def streamer(arrivals: _Arrivals) -> Any:
    """An `openvino_genai.StreamerBase` feeding `arrivals` and never stopping generation."""
    import openvino_genai as ov_genai

    class _Streamer(ov_genai.StreamerBase):  # type: ignore[misc]
        def write(self, token: int | Sequence[int]) -> Any:
            arrivals.write(token)
            return ov_genai.StreamingStatus.RUNNING

        def end(self) -> None:
            """Called once generation ends."""

    return _Streamer()


class OpenVinoRunner:
    """One OpenVINO GenAI `LLMPipeline` per method, on the CPU with our thread count.

    openvino: plain decoding; openvino-draft: a draft MODEL (exported with the same bits)
    proposing K tokens (`num_assistant_tokens`); openvino-lookup: prompt lookup
    (`num_assistant_tokens=K`, `max_ngram_size=max`). Prefix caching is off, so no request
    reuses another's KV (as in ours and llama.cpp's runs).
    """

    def __init__(
        self, spec: MethodSpec, folder: Path, eos: list[int], draft: Path | None = None
    ) -> None:
        """Load `folder` (a HF model folder; exported on first use, see `exported`) and, for
        openvino-draft, the draft model's folder `draft`."""
        try:
            import openvino_genai as ov_genai
        except ModuleNotFoundError as err:
            raise MissingDependencyError(
                f"the openvino* methods need OpenVINO GenAI: pip install {OPENVINO_REQUIREMENT}"
            ) from err
        bits = int(spec.option("bits") or 4)
        threads = torch.get_num_threads()  # the same threads as ours
        scheduler = ov_genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False
        properties: dict[str, Any] = {"scheduler_config": scheduler}
        if spec.kind == "openvino-draft":
            assert draft is not None, "openvino-draft takes a draft MODEL"
            properties["draft_model"] = ov_genai.draft_model(
                str(exported(draft, bits)), "CPU", INFERENCE_NUM_THREADS=threads
            )
        if spec.kind == "openvino-lookup":
            properties["prompt_lookup"] = True
        self.spec = spec
        self.eos = set(eos)
        self.pipe = ov_genai.LLMPipeline(
            str(exported(folder, bits)), "CPU", INFERENCE_NUM_THREADS=threads, **properties
        )

    def config(self, params: SamplingParams) -> Any:
        """OpenVINO's `GenerationConfig` for `params` and this method's K."""
        import openvino_genai as ov_genai

        config = ov_genai.GenerationConfig()
        config.max_new_tokens = params.max_tokens
        config.apply_chat_template = False  # the ids are already templated
        config.ignore_eos = params.ignore_eos
        config.stop_token_ids = set() if params.ignore_eos else self.eos
        if params.temperature > 0:
            config.do_sample = True
            config.temperature = params.temperature
            config.top_p = params.top_p
            if params.top_k > 0:
                config.top_k = params.top_k
            if params.seed is not None:
                config.rng_seed = params.seed
        if self.spec.kind != "openvino":
            config.num_assistant_tokens = int(self.spec.options["k"])
        if self.spec.kind == "openvino-lookup":
            config.max_ngram_size = int(self.spec.option("max") or 2)
        return config

    def run(self, ids: list[int], params: SamplingParams) -> Timing:
        """One request, an arrival per streamer event."""
        import openvino as ov
        import openvino_genai as ov_genai

        prompt = np.asarray([ids], dtype=np.int64)  # [1, prompt]
        inputs = ov_genai.TokenizedInputs(ov.Tensor(prompt), ov.Tensor(np.ones_like(prompt)))
        config = self.config(params)
        arrivals = _Arrivals()
        t0 = time.perf_counter()
        result = self.pipe.generate(inputs, config, streamer(arrivals))
        end = time.perf_counter()
        return Timing.measured(t0, end, arrivals.stamps, [int(t) for t in result.tokens[0]])
