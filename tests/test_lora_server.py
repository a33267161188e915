"""LoRA over HTTP against a real server process: adapters listed by /v1/models, selected by native `lora_path` and
by the OpenAI `model` (an adapter's name or `<model>:<adapter>`), unknown adapters a 404, and adapters loaded and
unloaded at run time."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from lora_utils import make_adapters, peft_greedy
from model_utils import make_tiny_model
from server_utils import wait_healthy

from radixserve.utils import free_port, kill_process_tree

pytestmark = pytest.mark.integration

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 11, 13], [300, 2, 3, 4]]
NEW = 8
SERVED = "tiny"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, embedded_model_path: str) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("lora_server")
    base = str(root / "base")
    make_tiny_model("llama", base, seed=3, vocab_size=512)
    paths = make_adapters(base, str(root))
    refs = {name: peft_greedy(base, paths.get(name) if name else None, PROMPTS, NEW) for name in (None, "a4", "b8",
                                                                                                  "c16")}
    port = free_port()
    log_path = str(root / "server.log")
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--model-path", base, "--tokenizer-path", embedded_model_path, "--served-model-name", SERVED,
           "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "2048", "--max-loras-per-batch", "2",
           "--lora-paths", f"a4={paths['a4']}", f"b8={paths['b8']}", "--max-lora-rank", "16"]
    log = open(log_path, "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"

    def tail() -> str:
        with open(log_path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-40:])

    try:
        wait_healthy(base_url, [proc], tail)
        with httpx.Client(base_url=base_url, timeout=120) as http:
            yield {"http": http, "refs": refs, "paths": paths}
    finally:
        if proc.poll() is None:
            kill_process_tree(proc.pid)
        log.close()


def gen(http: httpx.Client, prompt, lora) -> httpx.Response:
    return http.post("/generate", json={"input_ids": prompt, "lora_path": lora,
                                        "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                                            "ignore_eos": True}})


def test_models_list_adapters(setup) -> None:
    http = setup["http"]
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert set(cards) == {SERVED, "a4", "b8"}
    assert cards["a4"]["parent"] == SERVED and "parent" not in cards[SERVED]
    assert http.get("/v1/models/b8").json()["id"] == "b8"
    assert http.get("/v1/models/nope").status_code == 404


def test_native_lora_path(setup) -> None:
    http, refs = setup["http"], setup["refs"]
    assert gen(http, PROMPTS[0], "a4").json()["output_ids"] == refs["a4"][0]
    outs = gen(http, PROMPTS, [None, "b8"]).json()
    assert [o["output_ids"] for o in outs] == [refs[None][0], refs["b8"][1]]
    r = gen(http, PROMPTS[0], "nope")
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    assert gen(http, PROMPTS[0], None).json()["output_ids"] == refs[None][0]  # nothing else was harmed
    one = gen(http, PROMPTS[0], ["a4"])  # a single prompt's adapter in a list of one (as SGLang clients send it)
    assert one.status_code == 200 and one.json()["output_ids"] == refs["a4"][0], one.text
    for name in ("default", SERVED):  # names that select the base model as `model` cannot name an adapter
        r = http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": setup["paths"]["a4"]})
        assert r.status_code == 400 and "served model" in r.json()["error"]["message"], r.text


def test_openai_model_selects_the_adapter(setup) -> None:
    http = setup["http"]
    native = {name: gen(http, PROMPTS[1], name).json()["text"] for name in (None, "a4", "b8")}
    assert len(set(native.values())) == 3
    for model, name in [(SERVED, None), ("a4", "a4"), (f"{SERVED}:b8", "b8")]:
        r = http.post("/v1/completions", json={"model": model, "prompt": PROMPTS[1], "max_tokens": NEW,
                                               "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == native[name], model
        assert r.json()["model"] == model  # the adapter named as the request named it (as vLLM echoes it)
    r = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 2, "lora_path": "b8"})
    assert r.status_code == 200 and r.json()["model"] == "b8", r.text
    for body, status in [({"model": "nope"}, 404), ({"model": f"{SERVED}:nope"}, 404),
                         ({"model": "a4", "lora_path": "b8"}, 400)]:
        r = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 2, **body})
        assert r.status_code == status, (body, r.text)


def test_load_and_unload_at_run_time(setup) -> None:
    http, refs, paths = setup["http"], setup["refs"], setup["paths"]
    r = http.post("/load_lora_adapter", json={"lora_name": "c16", "lora_path": paths["c16"]})
    assert r.status_code == 200 and "c16" in r.json()["loaded_adapters"], r.text
    assert "c16" in {c["id"] for c in http.get("/v1/models").json()["data"]}
    # three adapters, two slots: a batch of all three runs in turns, each row right
    outs = gen(http, [PROMPTS[0]] * 3, ["a4", "b8", "c16"]).json()
    assert [o["output_ids"] for o in outs] == [refs["a4"][0], refs["b8"][0], refs["c16"][0]]
    r = http.post("/load_lora_adapter", json={"lora_name": "c16", "lora_path": paths["c16"]})
    assert r.status_code == 400 and "already" in r.json()["error"]["message"]
    r = http.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
    assert r.status_code == 400 and "not a folder" in r.json()["error"]["message"]
    assert http.post("/unload_lora_adapter", json={"lora_name": "c16"}).status_code == 200
    assert gen(http, PROMPTS[0], "c16").status_code == 404
    assert http.post("/unload_lora_adapter", json={"lora_name": "c16"}).status_code == 404
    assert http.post("/unload_lora_adapter", json={}).status_code == 400
    r = http.post("/load_lora_adapter", json={"lora_name": "c16", "lora_path": paths["c16"]})
    assert r.status_code == 200
    assert gen(http, PROMPTS[1], "c16").json()["output_ids"] == refs["c16"][1]
