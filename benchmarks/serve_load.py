"""Load-test `specdecode serve`: aggregate tokens/s, TTFT and inter-token latency against
concurrency, for several speculative configs served side by side.

    python benchmarks/serve_load.py --model qwen2.5-coder-1.5b --quantization int8 \\
        --config plain --config 'ngram={"method": "ngram", "num_speculative_tokens": 8}' \\
        --concurrency 1,4,16,64 --prompts code,chat --out bench_out/serve

Every config gets its own server process (`specdecode serve`, loopback), all started first
(one after another) and idle while another is measured, so the configs are interleaved: for
each repeat, each concurrency c, each config, c streaming clients send
`--requests-per-client` requests each (bench prompts, chat template, greedy, `--max-tokens`,
EOS ignored). Per request: time to the
first streamed token (TTFT) and the mean inter-token latency after it (ITL = (last - first) /
(tokens - 1)); per run: aggregate completion tokens / wall seconds. At c = 1, each request is
also run offline (`LLM.generate` in this process, same weights and config) right after the
server run, for the server-vs-offline ratio. Writes serve.json, serve.md and serve.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from specdecode.corpus.prompts import load_prompts
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams

START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Sample:
    """One request through the server: seconds to its first token and per later token."""

    tokens: int
    ttft_s: float
    itl_s: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: argparse.Namespace, name: str, spec: dict | None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [
        sys.executable, "-m", "specdecode.cli", "serve", args.model,
        "--port", str(port), "--served-model-name", "m", "--quantization", args.quantization,
        "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning",
    ]  # fmt: skip
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    log = open(Path(args.out) / f"server-{name}.log", "w")  # noqa: SIM115 (lives with the server)
    return subprocess.Popen(cmd, stdout=log, stderr=log), f"http://127.0.0.1:{port}"


def _wait(proc: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {base} exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server at {base} did not start")


async def _one(
    http: httpx.AsyncClient, base: str, prompt_ids: list[int], max_tokens: int
) -> Sample:
    body = {
        "model": "m", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with http.stream("POST", f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    assert first is not None and last is not None
    return Sample(tokens, first - start, (last - first) / max(1, tokens - 1))


async def _load(base: str, jobs: list[list[int]], concurrency: int, max_tokens: int) -> tuple:
    """Send `jobs` through `concurrency` clients; returns (samples, wall seconds)."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:

        async def client() -> None:
            while not queue.empty():
                samples.append(await _one(http, base, queue.get_nowait(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples, time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--quantization", default="int8")
    p.add_argument("--config", action="append", required=True, help="plain or NAME=JSON")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--prompts", default="code,chat")
    p.add_argument("--per-set", type=int, default=8)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8, help="per run, at least")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="bench_out/serve")
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    configs = {}
    for item in args.config:
        name, _, spec = item.partition("=")
        configs[name] = json.loads(spec) if spec else None
    offline = LLM(args.model, quantization=args.quantization)
    tok = offline.tokenizer
    sets = [load_prompts([name], args.per_set) for name in args.prompts.split(",")]
    prompts = [  # the sets interleaved, so that every run mixes them
        tok.encode(tok.apply_chat_template(list(b.messages), add_generation_prompt=True), False)
        for group in zip(*sets, strict=False)
        for b in group
    ]
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    results: dict = {"args": vars(args), "cpus": os.cpu_count(), "runs": []}
    try:
        for name, spec in configs.items():  # one at a time: loading peaks in memory
            servers[name] = _start(args, name, spec)
            _wait(*servers[name])
        for _, base in servers.values():  # warm-up: first-call costs count for none
            asyncio.run(_load(base, prompts[:2], 2, 8))
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for repeat in range(args.repeats):
            for c in [int(x) for x in args.concurrency.split(",")]:
                count = max(args.min_requests, c * args.requests_per_client)
                jobs = [prompts[(repeat * count + i) % len(prompts)] for i in range(count)]
                for name, (_, base) in servers.items():
                    samples, wall = asyncio.run(_load(base, jobs, c, args.max_tokens))
                    run = {"config": name, "concurrency": c, "repeat": repeat, "wall_s": wall,
                           "samples": [asdict(s) for s in samples]}  # fmt: skip
                    if c == 1:  # the same requests offline, same weights and config
                        llm = offline.with_speculative_config(configs[name])
                        start = time.perf_counter()
                        for job in jobs:
                            llm.generate({"prompt_token_ids": job}, params)
                        run["offline_s"] = time.perf_counter() - start
                    results["runs"].append(run)
                    tps = sum(s.tokens for s in samples) / wall
                    print(f"r{repeat} c={c:<3} {name:<24} {tps:7.2f} tok/s", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    (Path(args.out) / "serve.json").write_text(json.dumps(results, indent=1))
    report(results, Path(args.out))


def summarize(results: dict) -> list[dict]:
    """Per (config, concurrency): median aggregate tok/s over repeats (with range), TTFT and
    ITL p50/p99 over all requests, and at c = 1 the server / offline time ratio."""
    rows = []
    keys = dict.fromkeys((r["config"], r["concurrency"]) for r in results["runs"])
    for config, c in keys:
        runs = [r for r in results["runs"] if (r["config"], r["concurrency"]) == (config, c)]
        rates = [sum(s["tokens"] for s in r["samples"]) / r["wall_s"] for r in runs]
        samples = [s for r in runs for s in r["samples"]]
        ttft = [s["ttft_s"] for s in samples]
        itl = [s["itl_s"] for s in samples]
        row = {
            "config": config, "concurrency": c, "tok_s": statistics.median(rates),
            "tok_s_min": min(rates), "tok_s_max": max(rates),
            "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99),
            "itl_p50": _pct(itl, 0.5), "itl_p99": _pct(itl, 0.99),
        }  # fmt: skip
        if all("offline_s" in r for r in runs):
            row["server_vs_offline"] = statistics.median(r["offline_s"] / r["wall_s"] for r in runs)
        rows.append(row)
    return rows


def report(results: dict, out: Path) -> None:
    """serve.md (a table, speedups vs the first config) and serve.png."""
    rows = summarize(results)
    base = {r["concurrency"]: r["tok_s"] for r in rows if r["config"] == rows[0]["config"]}
    lines = [
        "| config | c | tok/s (range) | vs " + rows[0]["config"] + " | TTFT p50 / p99 (s) | "
        "ITL p50 / p99 (ms) | server / offline |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r.get("server_vs_offline")
        lines.append(
            f"| {r['config']} | {r['concurrency']} | {r['tok_s']:.1f} ({r['tok_s_min']:.1f}-"
            f"{r['tok_s_max']:.1f}) | {r['tok_s'] / base[r['concurrency']]:.2f}x | "
            f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | {1000 * r['itl_p50']:.0f} / "
            f"{1000 * r['itl_p99']:.0f} | {'' if ratio is None else f'{ratio:.2f}'} |"
        )
    (out / "serve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        cs = [r["concurrency"] for r in mine]
        axes[0].plot(cs, [r["tok_s"] for r in mine], marker="o", label=config)
        axes[1].plot(cs, [r["ttft_p50"] for r in mine], marker="o", label=config)
        axes[2].plot(cs, [1000 * r["itl_p50"] for r in mine], marker="o", label=config)
    titles = ("aggregate tokens/s", "TTFT p50 (s)", "inter-token latency p50 (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set(xscale="log", xlabel="concurrent streams", title=title)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "serve.png", dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
