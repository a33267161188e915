"""Embeddings through a real server (--is-embedding) with the official `openai` client and the native /encode:
equal to transformers' pooled final hidden states (float32, L2-normalised) for single, batched and token-array
inputs; last-token pooling on the embedded SmolLM2, mean pooling (from a sentence-transformers Pooling config)
over a prompt prefilled in chunks on a tiny random Llama; base64 encoding; `dimensions` only where the model
allows it; a repeated input served from the radix cache with the same vector; generation routes answer 400 on an
embedding server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from server_utils import wait_healthy

from radixserve.utils import free_port, kill_process_tree

pytestmark = pytest.mark.integration

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "Paris is the capital of France."]
ATOL = 1e-4


def _start(args: list[str], log_dir: Any) -> tuple[subprocess.Popen, str, Any]:
    port = free_port()
    log_path = log_dir / "server.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed at teardown
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--max-total-tokens", "4096", "--is-embedding", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, [proc], lambda: log_path.read_text()[-4000:])
    except BaseException:
        kill_process_tree(proc.pid)
        log.close()
        raise
    return proc, base, log


def _reference(folder: str, pooling: str) -> Any:
    """A function: token ids -> the normalised pooled last_hidden_state of transformers' model (float32)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()

    def embed(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            h = model(torch.tensor([ids])).last_hidden_state[0]
        v = h[-1] if pooling == "last" else h.mean(0)
        return torch.nn.functional.normalize(v, dim=0).numpy()

    return embed


@pytest.fixture(scope="module")
def smol(embedded_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any, Any]]:
    from transformers import AutoTokenizer

    proc, base, log = _start([], tmp_path_factory.mktemp("embed"))
    try:
        yield base, _reference(embedded_model_path, "last"), AutoTokenizer.from_pretrained(embedded_model_path)
    finally:
        kill_process_tree(proc.pid)
        log.close()


def test_openai_client_matches_transformers(smol: tuple[str, Any, Any]) -> None:
    base, ref, tok = smol
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    ids = [tok.encode(t) for t in TEXTS]
    # single string, a batch of strings (the client asks for base64 and decodes it), token arrays
    single = client.embeddings.create(model="default", input=TEXTS[0], encoding_format="float")
    assert len(single.data) == 1 and single.usage.prompt_tokens == len(ids[0])
    np.testing.assert_allclose(single.data[0].embedding, ref(ids[0]), atol=ATOL)
    batch = client.embeddings.create(model="default", input=TEXTS)
    assert [d.index for d in batch.data] == [0, 1, 2] and batch.usage.prompt_tokens == sum(map(len, ids))
    for d, i in zip(batch.data, ids, strict=True):
        assert len(d.embedding) == 576
        np.testing.assert_allclose(d.embedding, ref(i), atol=ATOL)
    one_ids = client.embeddings.create(model="default", input=ids[1], encoding_format="float")
    np.testing.assert_allclose(one_ids.data[0].embedding, ref(ids[1]), atol=ATOL)
    many_ids = client.embeddings.create(model="default", input=ids, encoding_format="float")
    for d, i in zip(many_ids.data, ids, strict=True):
        np.testing.assert_allclose(d.embedding, ref(i), atol=ATOL)
    # the full size is accepted as `dimensions`; a shorter one is not (SmolLM2 is not a Matryoshka model)
    assert len(client.embeddings.create(model="default", input="x", dimensions=576).data[0].embedding) == 576
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="default", input="x", dimensions=64)


def test_native_encode_and_radix_cache(smol: tuple[str, Any, Any]) -> None:
    base, ref, tok = smol
    text = "A sentence long enough to be worth caching, with a few more words at its end."
    with httpx.Client(base_url=base, timeout=120) as http:
        first = http.post("/encode", json={"text": text}).json()
        second = http.post("/encode", json={"text": text}).json()
        # last-token pooling: the second run finds the prompt (all but its last token) in the radix cache
        assert first["meta_info"]["cached_tokens"] == 0
        assert second["meta_info"]["cached_tokens"] == len(tok.encode(text)) - 1
        np.testing.assert_allclose(second["embedding"], first["embedding"], atol=ATOL)
        np.testing.assert_allclose(first["embedding"], ref(tok.encode(text)), atol=ATOL)
        both = http.post("/encode", json={"input_ids": [tok.encode(TEXTS[0]), tok.encode(TEXTS[1])]}).json()
        assert isinstance(both, list) and len(both) == 2
        np.testing.assert_allclose(both[1]["embedding"], ref(tok.encode(TEXTS[1])), atol=ATOL)
        # bad inputs are 400s; generation routes are 400s on an embedding server; the server stays up
        for path, body, param in [("/v1/embeddings", {"input": ""}, "input"),
                                  ("/v1/embeddings", {"input": []}, "input"),
                                  ("/v1/embeddings", {"input": [[1, 2], [10 ** 9]]}, "input"),
                                  ("/v1/embeddings", {"input": "x" * 50000}, "input"),
                                  ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
                                  ("/encode", {"text": "x", "input_ids": [1]}, "text"),
                                  ("/v1/embeddings", {"input": "x", "lora_path": "a4"}, "lora_path"),  # no adapters
                                  ("/encode", {"text": "x", "lora_path": "a4"}, "lora_path")]:
            r = http.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"}), ("/generate", {"text": "hi"})]:
            r = http.post(path, json=body)
            assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"]
        assert http.get("/get_model_info").json()["is_generation"] is False
        state = http.get("/get_internal_state").json()
        assert state["num_running_reqs"] == 0 and state["memory_ok"] is not False


@pytest.fixture(scope="module")
def tiny_mean(embedded_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A tiny random Llama (the SmolLM2 tokenizer) with mean pooling and Matryoshka dimensions in its folder."""
    from model_utils import make_tiny_model

    folder = tmp_path_factory.mktemp("mean_model")
    make_tiny_model("llama", str(folder), vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(embedded_model_path, name), folder / name)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32, 64]}))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                   "pooling_mode_mean_tokens": True}))
    proc, base, log = _start(["--model-path", str(folder), "--chunked-prefill-size", "16"],
                             tmp_path_factory.mktemp("mean"))
    try:
        yield base, str(folder)
    finally:
        kill_process_tree(proc.pid)
        log.close()


def test_mean_pooling_over_chunks_and_dimensions(tiny_mean: tuple[str, str]) -> None:
    base, folder = tiny_mean
    ref = _reference(folder, "mean")
    long_ids = [(i * 7919) % 40000 + 100 for i in range(45)]  # 45 tokens: three prefill chunks of 16
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    r = client.embeddings.create(model="default", input=[long_ids, long_ids[:5]], encoding_format="float")
    np.testing.assert_allclose(r.data[0].embedding, ref(long_ids), atol=ATOL)
    np.testing.assert_allclose(r.data[1].embedding, ref(long_ids[:5]), atol=ATOL)
    # again: a mean needs every token's hidden state, so the cache is not used and the result is the same
    again = client.embeddings.create(model="default", input=long_ids, encoding_format="float")
    np.testing.assert_allclose(again.data[0].embedding, r.data[0].embedding, atol=ATOL)
    # Matryoshka dimensions: the first n values, normalised again; others are refused
    short = client.embeddings.create(model="default", input=long_ids, dimensions=16)
    full = np.asarray(r.data[0].embedding)
    np.testing.assert_allclose(short.data[0].embedding, full[:16] / np.linalg.norm(full[:16]), atol=ATOL)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="default", input="x", dimensions=20)


def test_engine_encode_matches_transformers(embedded_model_path: str) -> None:
    """The offline Engine with is_embedding=True: encode() gives transformers' pooled, normalised hidden states
    for a text, a batch of texts and token ids (as /encode does); generate() is refused with a ValueError."""
    from transformers import AutoTokenizer

    from radixserve.entrypoints.engine import Engine

    ref = _reference(embedded_model_path, "last")
    tok = AutoTokenizer.from_pretrained(embedded_model_path)
    with Engine(model_path=embedded_model_path, is_embedding=True, max_total_tokens=2048, log_level="warning") as e:
        one = e.encode(TEXTS[0])
        assert one["meta_info"]["prompt_tokens"] == len(tok.encode(TEXTS[0]))
        np.testing.assert_allclose(one["embedding"], ref(tok.encode(TEXTS[0])), atol=ATOL)
        many = e.encode(TEXTS)
        assert isinstance(many, list) and len(many) == len(TEXTS)
        for text, out in zip(TEXTS, many, strict=True):
            np.testing.assert_allclose(out["embedding"], ref(tok.encode(text)), atol=ATOL)
        ids = tok.encode(TEXTS[1])
        np.testing.assert_allclose(e.encode(input_ids=ids)["embedding"], ref(ids), atol=ATOL)
        with pytest.raises(ValueError, match="encode"):
            e.generate(TEXTS[0], {"max_new_tokens": 2})
        with pytest.raises(ValueError, match="exactly one"):
            e.encode(TEXTS[0], input_ids=ids)
