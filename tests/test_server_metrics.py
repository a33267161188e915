"""What a real server reports about its own work: /metrics (Prometheus) and /stats (the dashboard) against the
`usage` of the answers that produced it, and its request log. One `python -m radixserve.launch_server` process on
the embedded SmolLM2 (--enable-metrics, --api-key, --log-requests)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import Server, serving

pytestmark = pytest.mark.integration  # every test here starts processes

API_KEY = "sk-metrics-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(embedded_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--max-total-tokens", "4096", "--enable-metrics", "--api-key", API_KEY, "--log-requests"]
    with serving(str(tmp_path_factory.mktemp("server") / "server.log"), args) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base, headers=AUTH, timeout=120) as c:
        yield c


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        st = http.get("/get_internal_state").json()
        if st["idle"] and st["num_inflight_requests"] == 0:
            return
        assert time.monotonic() < deadline, f"server not idle after {timeout} s: {st}"
        time.sleep(0.1)


def scrape(http: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics by name and labels (model_name left out), once the server is idle."""
    wait_idle(http)
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            key = f"{s.name}{{{labels}}}" if labels else s.name
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The counters and histogram counts that changed (the _created timestamps and buckets left out)."""
    return {k: after[k] - before.get(k, 0.0) for k in after
            if after[k] != before.get(k, 0.0) and "_created" not in k and "_bucket" not in k
            and not k.endswith("_sum") and k.split("{")[0].endswith(("_total", "_count"))}


def stats(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/stats")
    assert r.status_code == 200, r.text
    return r.json()


def test_health_probes_stay_out_of_the_request_metrics(http: httpx.Client) -> None:
    """A load balancer polling /health_generate generates a token each time; those are not users' requests."""
    before, stats_before = scrape(http), stats(http)
    for _ in range(2):
        assert http.get("/health_generate").status_code == 200
    after, stats_after = scrape(http), stats(http)
    assert moved(before, after) == {}
    assert stats_after["num_finished_reqs"] == stats_before["num_finished_reqs"]
    assert stats_after["generated_tokens"] == stats_before["generated_tokens"]


def test_n_samples_are_n_requests_without_the_shared_prefill(http: httpx.Client) -> None:
    """n > 1 prefills the prompt once, internally, before the samples: /metrics counts the n samples, each with the
    prompt (as vLLM counts them), and never that internal request (which "finished" with length)."""
    before, stats_before = scrape(http), stats(http)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Metrics with two samples", "max_tokens": 3,
                                           "n": 2, "temperature": 1.0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    after, stats_after = scrape(http), stats(http)
    n = 2
    delta = moved(before, after)
    # each sample found all the prompt but its last token cached (the shared prefill put it there)
    assert delta.pop("radixserve:cached_tokens_total") == n * usage["prompt_tokens_details"]["cached_tokens"]
    per_request = ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                   *(f"time_to_first_token_stage_seconds_count{{stage={s}}}"
                     for s in ("deliver", "dispatch", "prefill", "queue")))
    assert delta == {"radixserve:num_requests_total{finish_reason=length}": n,
                     "radixserve:prompt_tokens_total": n * usage["prompt_tokens"],
                     "radixserve:generation_tokens_total": usage["completion_tokens"],
                     **{f"radixserve:{name}": n for name in per_request}}
    assert stats_after["num_finished_reqs"] - stats_before["num_finished_reqs"] == n


def test_stats_count_every_token_of_an_answer_sent_at_once(http: httpx.Client) -> None:
    """A non-streamed answer reaches the server in one piece: the dashboard's token count (and throughput) must
    take all its tokens, not one."""
    before = stats(http)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Dashboard tokens", "max_tokens": 6,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    after = stats(http)
    assert after["generated_tokens"] - before["generated_tokens"] == r.json()["usage"]["completion_tokens"] == 6
    assert after["gen_throughput"] > 0


def test_request_log_keeps_client_text_on_its_own_line(server: Server, http: httpx.Client) -> None:
    """--log-requests writes the path and the rid a client chose: a newline in them must not forge a log line
    (the page's static files need no key, so anyone can send such a path)."""
    forged = "[2000-01-01 00:00:00,000] INFO radixserve.entrypoints.http_server: POST /forged -> 200"
    assert httpx.get(server.base + "/static/x%0A" + forged.replace(" ", "%20")).status_code == 404
    r = http.post("/generate", json={"text": "Hi", "rid": "rid\n" + forged.replace("/forged", "/forged-rid"),
                                     "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text
    wait_idle(http)
    lines = server.log().splitlines()
    assert not [ln for ln in lines if ln.startswith(forged[:20])]
    assert any("/static/x\\n[2000-01-01" in ln for ln in lines)
    assert any("request rid\\n[2000-01-01" in ln for ln in lines)
    assert API_KEY not in server.log()


def test_a_non_streamed_answer_s_ttft_ends_at_its_first_token(http: httpx.Client) -> None:
    """The scheduler holds a non-streamed answer's tokens until it ends: its TTFT is taken at the scheduler's stamp
    of the first token (as vLLM times it), not when the whole answer arrives, which is the end-to-end latency."""
    def sums(m: dict[str, float]) -> tuple[float, float]:
        return (m["radixserve:time_to_first_token_seconds_sum"], m["radixserve:e2e_request_latency_seconds_sum"])

    before = sums(scrape(http))
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "A long answer", "max_tokens": 48,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    ttft, e2e = (a - b for a, b in zip(sums(scrape(http)), before, strict=True))
    assert 0 < ttft < e2e / 4, (ttft, e2e)  # 47 decode steps after the first token
