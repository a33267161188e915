"""Online serving benchmark against any OpenAI-compatible server (radixserve, SGLang, vLLM, ...).

    python -m radixserve.bench_serving --base-url http://127.0.0.1:30000 --backend radixserve \\
        --dataset random --num-prompts 200 --request-rate 8 --max-concurrency 32 --plot bench.png

Requests arrive as a Poisson process at --request-rate (inf: all at once), at most --max-concurrency in flight, and
stream their output. Printed and written to JSON: request/token throughput, and mean/median/p90/p99 of time to first
token (TTFT), inter-token latency (ITL, the gaps between streamed chunks), time per output token after the first
(TPOT) and end-to-end latency; against a radixserve server started with --enable-metrics, also the mean of each
stage of its TTFT as the server saw it (dispatch, queue, prefill, deliver). A chunk counts as an arrival when it
brings text or, on the native API (whose chunks carry the output token count), more tokens: tokens that decode to no
text yet are not folded into the next gap. --plot writes a PNG with their distributions and the output throughput
over time.

Backends: `radixserve` (native POST /generate, SSE of cumulative outputs), `openai` (POST /v1/completions) and
`openai-chat` (POST /v1/chat/completions). Datasets are synthetic so no download is needed: `random` (random token
ids decoded to text) and `shared-prefix` (groups of prompts sharing a long system prefix, which a prefix cache
should turn into cache hits).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

BACKENDS = ("radixserve", "openai", "openai-chat")
DATASETS = ("random", "shared-prefix")


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    generated_text: str = ""
    start: float = 0.0  # seconds since the benchmark started
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # seconds since the benchmark started


# ====================================================================== datasets
def load_tokenizer(path: str | None) -> Any:
    from transformers import AutoTokenizer

    if path is None:
        from radixserve.model_loader.embedded import ensure_embedded_model

        path = ensure_embedded_model()
    return AutoTokenizer.from_pretrained(path)


def _random_text(tokenizer: Any, rng: random.Random, n_tokens: int, allowed: list[int]) -> str:
    return tokenizer.decode([rng.choice(allowed) for _ in range(n_tokens)], skip_special_tokens=True)


def _allowed_ids(tokenizer: Any) -> list[int]:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = len(tokenizer)
    return [i for i in range(vocab) if i not in special]


def _sample_len(rng: random.Random, length: int, ratio: float) -> int:
    return max(1, rng.randint(max(1, int(length * ratio)), max(1, length)))


def sample_random(tokenizer: Any, num: int, input_len: int, output_len: int, ratio: float,
                  seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    allowed = _allowed_ids(tokenizer)
    out = []
    for _ in range(num):
        text = _random_text(tokenizer, rng, _sample_len(rng, input_len, ratio), allowed)
        out.append(BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False)),
                                _sample_len(rng, output_len, ratio)))
    return out


def sample_shared_prefix(tokenizer: Any, num: int, groups: int, prefix_len: int, question_len: int,
                         output_len: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    allowed = _allowed_ids(tokenizer)
    prefixes = [_random_text(tokenizer, rng, prefix_len, allowed) for _ in range(max(1, groups))]
    out = []
    for i in range(num):
        text = prefixes[i % len(prefixes)] + "\n\nQuestion: " + _random_text(tokenizer, rng, question_len, allowed)
        out.append(BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), output_len))
    rng.shuffle(out)
    return out


# ====================================================================== one request per backend
def _payload(backend: str, model: str, req: BenchRequest, ignore_eos: bool) -> tuple[str, dict[str, Any]]:
    if backend == "radixserve":
        sp: dict[str, Any] = {"max_new_tokens": req.output_len, "temperature": 0.0}
        if ignore_eos:
            sp["ignore_eos"] = True
        return "/generate", {"text": req.prompt, "sampling_params": sp, "stream": True}
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if backend == "openai":
        body["prompt"] = req.prompt
        return "/v1/completions", body
    body["messages"] = [{"role": "user", "content": req.prompt}]
    return "/v1/chat/completions", body


def _delta(backend: str, chunk: dict[str, Any], text_so_far: str) -> tuple[str, int | None]:
    """New text of a chunk and, when the chunk says so, the number of output tokens so far."""
    if backend == "radixserve":
        text = chunk.get("text", "")
        meta = chunk.get("meta_info") or {}
        return text[len(text_so_far):], meta.get("completion_tokens")
    usage = chunk.get("usage") or {}
    tokens = usage.get("completion_tokens")
    choices = chunk.get("choices") or []
    if not choices:
        return "", tokens
    c = choices[0]
    if backend == "openai":
        return c.get("text") or "", tokens
    return (c.get("delta") or {}).get("content") or "", tokens


async def send_request(session: Any, base_url: str, backend: str, model: str, req: BenchRequest, ignore_eos: bool,
                       headers: dict[str, str], t0: float) -> RequestResult:
    path, body = _payload(backend, model, req, ignore_eos)
    res = RequestResult(prompt_len=req.prompt_len)
    start = time.perf_counter()
    res.start = start - t0
    last = start
    text = ""
    tokens: int | None = None
    arrivals = 0
    try:
        async with session.post(base_url + path, json=body, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            buffer = b""
            async for raw in resp.content.iter_any():
                buffer += raw
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        chunk = json.loads(data)
                        if "error" in chunk:
                            res.error = str(chunk["error"].get("message", chunk["error"]))
                            return res
                        delta, n = _delta(backend, chunk, text)
                        # a chunk counts when it brings tokens: new text, or (native API, which reports the count
                        # in every chunk) more output tokens even if they decode to no text yet (a partial UTF-8
                        # character; random weights' ids beyond the tokenizer's vocabulary)
                        grew = backend == "radixserve" and n is not None and n > (tokens or 0)
                        if n is not None:
                            tokens = n
                        if not delta and not grew:
                            continue
                        now = time.perf_counter()
                        if arrivals == 0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        res.chunk_times.append(now - t0)
                        last = now
                        arrivals += 1
                        text += delta
    except Exception as e:  # connection errors are results, not crashes
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.generated_text = text
    res.output_len = tokens if tokens is not None else arrivals
    res.success = arrivals > 0 or res.output_len == 0
    if not res.success:
        res.error = "no output"
    return res


# ====================================================================== driver
async def _arrivals(n: int, rate: float, rng: random.Random) -> Any:
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def run_benchmark(args: argparse.Namespace, requests: list[BenchRequest], model: str) -> tuple[
        list[RequestResult], float, dict[str, float] | None]:
    """Send the requests; their results, the duration and the server's mean TTFT stages (None without metrics)."""
    import aiohttp
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc="requests", unit="req")
    rng = random.Random(args.seed)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        # one short request first: fails fast (wrong URL, key or model) before the clock starts
        probe = BenchRequest(requests[0].prompt, requests[0].prompt_len, 1)
        warm = await send_request(session, args.base_url, args.backend, model, probe, False, headers,
                                  time.perf_counter())
        if not warm.success:
            bar.close()
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        stages_before = await asyncio.to_thread(scrape_ttft_stages, args.base_url, args.api_key)
        t0 = time.perf_counter()

        async def one(i: int) -> RequestResult:
            if sem is None:
                r = await send_request(session, args.base_url, args.backend, model, requests[i],
                                       not args.disable_ignore_eos, headers, t0)
            else:
                async with sem:
                    r = await send_request(session, args.base_url, args.backend, model, requests[i],
                                           not args.disable_ignore_eos, headers, t0)
            bar.update(1)
            return r

        tasks = []
        async for i in _arrivals(len(requests), args.request_rate, rng):
            tasks.append(asyncio.create_task(one(i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        stages_after = await asyncio.to_thread(scrape_ttft_stages, args.base_url, args.api_key)
    bar.close()
    return list(results), duration, stage_means_ms(stages_before, stages_after)


TTFT_STAGE_METRIC = "radixserve:time_to_first_token_stage_seconds"


def scrape_ttft_stages(base_url: str, api_key: str | None = None) -> dict[str, tuple[float, float]] | None:
    """(sum of seconds, count) per TTFT stage from the server's /metrics, or None where it has none (metrics off,
    another engine)."""
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(base_url + "/metrics")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    out: dict[str, list[float]] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return None
    for family in families:
        if family.name != TTFT_STAGE_METRIC:
            continue
        for sample in family.samples:
            stage = sample.labels.get("stage")
            if stage is None or not sample.name.endswith(("_sum", "_count")):
                continue
            acc = out.setdefault(stage, [0.0, 0.0])
            acc[0 if sample.name.endswith("_sum") else 1] += sample.value
    return {k: (v[0], v[1]) for k, v in out.items()} or None


def stage_means_ms(before: dict[str, tuple[float, float]] | None,
                   after: dict[str, tuple[float, float]] | None) -> dict[str, float] | None:
    """Mean milliseconds per stage over the requests observed between two scrapes."""
    if after is None:
        return None
    before = before or {}
    means = {}
    order = ["dispatch", "queue", "prefill", "deliver"]
    for stage in order + sorted(set(after) - set(order)):
        if stage not in after:
            continue
        total, count = after[stage]
        t0, c0 = before.get(stage, (0.0, 0.0))
        if count > c0:
            means[stage] = 1000 * (total - t0) / (count - c0)
    return means or None


def _percentiles(values: list[float]) -> dict[str, float]:
    import numpy as np

    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": input_tokens / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration else 0.0,
        "ttft_ms": {k: 1000 * v for k, v in _percentiles([r.ttft for r in ok]).items()},
        "itl_ms": {k: 1000 * v for k, v in _percentiles([x for r in ok for x in r.itl]).items()},
        "tpot_ms": {k: 1000 * v for k, v in _percentiles(tpot).items()},
        "e2e_latency_ms": {k: 1000 * v for k, v in _percentiles([r.latency for r in ok]).items()},
        "errors": errors,
    }


def format_table(summary: dict[str, Any], args: argparse.Namespace) -> str:
    w = 44
    lines = ["=" * 20 + " Serving Benchmark Result " + "=" * 20]

    def row(name: str, value: Any) -> None:
        lines.append(f"{name:<{w}}{value:>22}")

    row("Backend:", args.backend)
    row("Dataset:", args.dataset)
    row("Request rate (req/s):", str(args.request_rate))
    row("Max concurrency:", str(args.max_concurrency or "unlimited"))
    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", f"{summary['duration_s']:.2f}")
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total output tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", f"{summary['request_throughput']:.2f}")
    row("Input token throughput (tok/s):", f"{summary['input_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}")
    for key, title in (("ttft_ms", "Time to First Token"), ("itl_ms", "Inter-token Latency"),
                       ("tpot_ms", "Time per Output Token (excl. 1st)"), ("e2e_latency_ms", "End-to-End Latency")):
        lines.append("-" * 22 + f" {title} " + "-" * max(1, 42 - len(title)))
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize()} {key.split('_')[0].upper()} (ms):", f"{summary[key][stat]:.2f}")
        if key == "ttft_ms" and summary.get("server_ttft_stages_ms"):
            for stage, ms in summary["server_ttft_stages_ms"].items():
                row(f"Server TTFT {stage}, mean (ms):", f"{ms:.2f}")
    for err, n in summary["errors"].items():
        lines.append(f"error x{n}: {err}")
    lines.append("=" * 66)
    return "\n".join(lines)


def plot(results: list[RequestResult], duration: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [(axes[0][0], [1000 * r.ttft for r in ok], "TTFT (ms)"),
              (axes[0][1], [1000 * x for r in ok for x in r.itl], "inter-token latency (ms)"),
              (axes[1][0], [1000 * r.latency for r in ok], "end-to-end latency (ms)")]
    for ax, values, label in panels:
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:blue", alpha=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    ax = axes[1][1]
    bins = max(1, int(duration) + 1)
    counts = [0.0] * bins
    for r in ok:  # spread each request's tokens over its streamed chunks
        if r.chunk_times:
            per_chunk = r.output_len / len(r.chunk_times)
            for t in r.chunk_times:
                counts[min(bins - 1, max(0, int(t)))] += per_chunk
    ax.plot(range(bins), counts, color="tab:green")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens / s")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _model_name(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    import urllib.request

    req = urllib.request.Request(args.base_url + "/v1/models")
    if args.api_key:
        req.add_header("Authorization", f"Bearer {args.api_key}")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark an OpenAI-compatible LLM server.")
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--backend", choices=BACKENDS, default="radixserve")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for prompts and counts (default: embedded)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.5, help="lengths drawn from [ratio*len, len]")
    p.add_argument("--shared-prefix-groups", type=int, default=4)
    p.add_argument("--shared-prefix-len", type=int, default=512)
    p.add_argument("--shared-question-len", type=int, default=64)
    p.add_argument("--shared-output-len", type=int, default=64)
    p.add_argument("--disable-ignore-eos", action="store_true", help="do not send ignore_eos (strict OpenAI APIs)")
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="JSON results (default: bench_serving_<time>.json)")
    p.add_argument("--plot", default=None, help="write a PNG of latency distributions and throughput over time")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    if args.num_prompts < 1:
        print("bench_serving: --num-prompts must be >= 1", file=sys.stderr)
        return 2
    if args.request_rate <= 0:
        print("bench_serving: --request-rate must be > 0 (inf for all at once)", file=sys.stderr)
        return 2
    if args.max_concurrency is not None and args.max_concurrency < 1:
        print("bench_serving: --max-concurrency must be >= 1", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(args.tokenizer)
    if args.dataset == "random":
        requests = sample_random(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, args.seed)
    else:
        requests = sample_shared_prefix(tokenizer, args.num_prompts, args.shared_prefix_groups,
                                        args.shared_prefix_len, args.shared_question_len, args.shared_output_len,
                                        args.seed)
    try:
        model = _model_name(args)
        results, duration, stages = asyncio.run(run_benchmark(args, requests, model))
    except Exception as e:
        print(f"bench_serving: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    summary = summarize(results, duration)
    summary["server_ttft_stages_ms"] = stages
    print(format_table(summary, args))
    out = args.output_file or f"bench_serving_{time.strftime('%Y%m%d_%H%M%S')}.json"
    record = {"args": {k: (v if v != float("inf") else "inf") for k, v in vars(args).items() if k != "api_key"},
              "model": model, "summary": summary,
              "requests": [{k: v for k, v in asdict(r).items() if k != "generated_text"} for r in results]}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"results written to {out}")
    if args.plot:
        plot(results, duration, args.plot, f"{args.backend} {args.dataset}: {args.num_prompts} prompts, "
             f"rate {args.request_rate}, concurrency {args.max_concurrency or 'unlimited'}")
        print(f"plot written to {args.plot}")
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
