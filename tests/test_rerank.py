"""Cross-encoders (models/bert_rerank.py) and the rerank / score API (entrypoints/openai/serving_score.py): tiny
random BertForSequenceClassification and XLMRobertaForSequenceClassification (num_labels 1) give transformers'
logits for (query, document) pairs encoded as pairs, several documents of different lengths in one forward
(float32, 1e-5); BERT's second segment gets token type 1 (derived from the first [SEP]: with the types zeroed the
logits change), the scores are never normalised. The request shapes: pairs of a score request, top_n and
return_documents ordering, the 400s (empty lists, mismatched lists, a model that is not a cross-encoder). One
end-to-end test through a real server: /v1/rerank and /v1/score equal sigmoid(transformers' logits)."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from server_utils import wait_healthy
from test_bert_embeddings import MAX_POS, _embed, _scheduler, _tokenizer

from radixserve.configs.encoder import embedding_normalize, is_classifier
from radixserve.configs.model_config import ModelConfig
from radixserve.entrypoints.openai import serving_score as ss
from radixserve.entrypoints.openai.errors import APIError
from radixserve.models.bert_rerank import pair_token_types
from radixserve.utils import free_port, kill_process_tree

ATOL = 1e-5
QUERY = "paris capital"
DOCS = ["paris is the capital of france", "the quick brown fox", "hello world", "zzz, dog jumps over lazy fox"]


def _hf_classifier(kind: str) -> Any:
    import transformers as tf

    torch.manual_seed(2 if kind == "bert" else 3)
    shape = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=MAX_POS, num_labels=1)
    if kind == "bert":
        model = tf.BertForSequenceClassification(tf.BertConfig(**shape))
        with torch.no_grad():  # make the second segment's type embedding (and the head) matter
            model.bert.embeddings.token_type_embeddings.weight[1] += 0.5
            model.classifier.weight.mul_(40)
    else:
        model = tf.XLMRobertaForSequenceClassification(tf.XLMRobertaConfig(**shape, type_vocab_size=1, pad_token_id=1,
                                                                           bos_token_id=0, eos_token_id=2))
        with torch.no_grad():
            model.classifier.out_proj.weight.mul_(40)
    return model.eval()


def _logits(model: Any, tok: Any, query: str, docs: list[str], zero_types: bool = False) -> np.ndarray:
    out = []
    with torch.no_grad():
        for d in docs:
            enc = tok(query, d, return_tensors="pt")
            if zero_types and "token_type_ids" in enc:
                enc["token_type_ids"] = torch.zeros_like(enc["token_type_ids"])
            out.append(model(**enc).logits[0].numpy())
    return np.stack(out)


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, str]]:
    """kind -> (the transformers model, its saved folder with the tokenizer)."""
    out = {}
    for kind in ("bert", "xlmr"):
        model, folder = _hf_classifier(kind), str(tmp_path_factory.mktemp(f"rerank_{kind}"))
        model.save_pretrained(folder)
        _tokenizer(kind).save_pretrained(folder)
        out[kind] = (model, folder)
    return out


@pytest.mark.parametrize("kind", ["bert", "xlmr"])
def test_pair_logits_match_transformers(kind: str, classifiers: dict[str, tuple[Any, str]]) -> None:
    model, folder = classifiers[kind]
    tok = _tokenizer(kind)
    cfg = ModelConfig(folder)
    assert cfg.is_encoder and is_classifier(cfg.architectures) and not embedding_normalize(folder, cfg.architectures)
    s = _scheduler(folder)
    assert s.server_args.is_embedding and s.server_args.disable_radix_cache and not s.embed_normalize
    pairs = [tok.encode(QUERY, d) for d in DOCS]
    assert len({len(p) for p in pairs}) == len(DOCS)  # different lengths: one padded forward
    got, _ = _embed(s, pairs, "cls")
    want = _logits(model, tok, QUERY, DOCS)
    np.testing.assert_allclose(np.array(got), want, atol=ATOL)
    (one,), _ = _embed(s, pairs[2:3], "cls")  # alone, and pooled "last": the head still reads the first token
    np.testing.assert_allclose(one, want[2], atol=ATOL)
    (last,), _ = _embed(s, pairs[1:2], "last")
    np.testing.assert_allclose(last, want[1], atol=ATOL)
    zeroed = _logits(model, tok, QUERY, DOCS, zero_types=True)
    if kind == "bert":  # the second segment's token types change the scores; XLM-R has a single type
        assert np.abs(zeroed - want).max() > 100 * ATOL
    else:
        np.testing.assert_allclose(zeroed, want, atol=ATOL)
    scores = ss.relevance_scores(got)
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-want[:, 0])), atol=ATOL)
    assert len(set(np.round(scores, 4))) == len(DOCS)  # distinct: the ordering below is meaningful


def test_pair_token_types_follow_the_tokenizer() -> None:
    tok = _tokenizer("bert")
    encs = [tok(QUERY, d) for d in DOCS] + [tok("hello world")]  # a single text: all type 0
    ids = torch.tensor([t for e in encs for t in e["input_ids"]])
    lens = torch.tensor([len(e["input_ids"]) for e in encs])
    got = pair_token_types(ids, lens, tok.sep_token_id).tolist()
    assert got == [t for e in encs for t in e["token_type_ids"]]


def test_request_shapes_and_errors() -> None:
    assert ss.score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert ss.score_pairs(["a", "b"], "d") == [("a", "d"), ("b", "d")]
    assert ss.score_pairs(["a", "b"], ["c", "d"]) == [("a", "c"), ("b", "d")]
    with pytest.raises(ss.ScoreInputError, match="same length"):
        ss.score_pairs(["a", "b"], ["c", "d", "e"])
    with pytest.raises(ss.ScoreInputError, match="text_2: must not be empty"):
        ss.score_pairs("q", [])
    with pytest.raises(ss.ScoreInputError, match="documents: must not be empty") as e:
        ss.rerank_pairs("q", [])
    assert e.value.param == "documents"
    results = ss.ranked([0.2, 0.9, 0.5], ["a", "b", "c"], None, True)
    assert [r["index"] for r in results] == [1, 2, 0] and results[0]["document"] == {"text": "b"}
    top = ss.ranked([0.2, 0.9, 0.5], ["a", "b", "c"], 2, False)
    assert top == [{"index": 1, "relevance_score": 0.9}, {"index": 2, "relevance_score": 0.5}]
    with pytest.raises(ss.ScoreInputError, match="top_n"):
        ss.ranked([0.1], ["a"], 0, True)
    assert ss.relevance_scores([[0.0], [-800.0], [800.0]]) == [0.5, 0.0, 1.0]
    # a server whose model is not a cross-encoder: a 400 naming it
    for emb in (None, SimpleNamespace(cross_encoder=False)):
        state = SimpleNamespace(embeddings=emb, tm=SimpleNamespace(model_config=SimpleNamespace(
            architectures=["LlamaForCausalLM"])))
        with pytest.raises(APIError, match="cross-encoder.*LlamaForCausalLM") as err:
            ss.score_service(state)
        assert err.value.status_code == 400


@pytest.fixture(scope="module")
def rerank_server(classifiers: dict[str, tuple[Any, str]],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real server on the BERT cross-encoder folder (no --is-embedding: the model implies it)."""
    folder, port = classifiers["bert"][1], free_port()
    log_path = tmp_path_factory.mktemp("rerank_server") / "server.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen([sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1", "--port",
                             str(port), "--model-path", folder, "--max-total-tokens", "1024"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, [proc], lambda: log_path.read_text()[-4000:])
        yield base
    finally:
        kill_process_tree(proc.pid)
        log.close()


@pytest.mark.integration
def test_server_rerank_and_score(rerank_server: str, classifiers: dict[str, tuple[Any, str]]) -> None:
    model, _ = classifiers["bert"]
    tok = _tokenizer("bert")
    want = 1 / (1 + np.exp(-_logits(model, tok, QUERY, DOCS)[:, 0]))
    with httpx.Client(base_url=rerank_server, timeout=120) as http:
        r = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("rerank-") and body["model"]
        assert [x["index"] for x in body["results"]] == list(np.argsort(-want))
        for x in body["results"]:
            assert math.isclose(x["relevance_score"], want[x["index"]], abs_tol=1e-4)
            assert x["document"] == {"text": DOCS[x["index"]]}
        assert body["usage"]["total_tokens"] == sum(len(tok.encode(QUERY, d)) for d in DOCS)
        r = http.post("/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                                       "return_documents": False})
        assert [x["index"] for x in r.json()["results"]] == list(np.argsort(-want)[:2])
        assert "document" not in r.json()["results"][0]
        r = http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(DOCS)))
        assert all(d["object"] == "score" for d in body["data"])
        np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-4)
        r = http.post("/v1/score", json={"text_1": [QUERY, QUERY], "text_2": DOCS[:2]})
        np.testing.assert_allclose([d["score"] for d in r.json()["data"]], want[:2], atol=1e-4)
        # the 400s, OpenAI-style; the server stays up
        for path, payload, param in [
            ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
            ("/v1/rerank", {"query": QUERY, "documents": ["fox " * MAX_POS]}, "documents"),
            ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, None),
            ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
            ("/v1/embeddings", {"input": "hello"}, "model"),
        ]:
            r = http.post(path, json=payload)
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert param is None or err["param"] == param, (path, err)
        r = http.post("/v1/rerank", json={"query": QUERY, "documents": ["fox " * MAX_POS]})
        assert "context length" in r.json()["error"]["message"]
        assert http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS[:1]}).status_code == 200


@pytest.mark.integration
def test_engine_rerank_and_score(classifiers: dict[str, tuple[Any, str]]) -> None:
    """Engine.rerank / Engine.score on the XLM-R cross-encoder (bge-reranker's architecture)."""
    from radixserve.entrypoints.engine import Engine

    model, folder = classifiers["xlmr"]
    want = 1 / (1 + np.exp(-_logits(model, _tokenizer("xlmr"), QUERY, DOCS)[:, 0]))
    with Engine(model_path=folder, max_total_tokens=1024, log_level="warning") as e:
        results = e.rerank(QUERY, DOCS, top_n=3)
        assert [r["index"] for r in results] == list(np.argsort(-want)[:3])
        np.testing.assert_allclose([r["relevance_score"] for r in results], np.sort(want)[::-1][:3], atol=1e-5)
        assert results[0]["document"] == {"text": DOCS[results[0]["index"]]}
        np.testing.assert_allclose(e.score(QUERY, DOCS), want, atol=1e-5)
        with pytest.raises(ValueError, match="documents: must not be empty"):
            e.rerank(QUERY, [])
        with pytest.raises(ValueError, match="context length"):
            e.score(QUERY, "fox " * MAX_POS)
