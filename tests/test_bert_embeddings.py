"""Encoder-only embedding models (models/bert.py, configs/encoder.py): tiny random BertModel and XLMRobertaModel saved
as sentence-transformers folders give transformers' last_hidden_state pooled per their 1_Pooling config (CLS or mean)
and normalised when modules.json says so (float32, ~1e-5): single inputs and a batch of inputs of different lengths
in one forward, a request sharing a prefix with an earlier one (never served from a cache), a prompt that fills the
position table; a longer one is a 400. Masked-LM checkpoints load from under their `bert.` prefix. The server forces
what an encoder needs (embeddings, no radix cache, no chunking) and warms up without decoding. One end-to-end test
through a real server with text input (the tokenizer adds [CLS] / [SEP])."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from server_utils import wait_healthy

from radixserve.configs.encoder import apply_encoder_args, embedding_normalize
from radixserve.configs.model_config import ModelConfig
from radixserve.entrypoints.openai.serving_embedding import model_pooling
from radixserve.managers import io_struct as io
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from radixserve.utils import free_port, kill_process_tree

ATOL = 1e-5
WORDS = "hello world the quick brown fox jumps over lazy dog paris is capital of france".split()
MAX_POS = 40  # BERT: 40 tokens; XLM-R: 40 - (padding_idx + 1) = 38


def _tokenizer(kind: str) -> Any:
    letters = "abcdefghijklmnopqrstuvwxyz"
    if kind == "bert":
        from transformers import BertTokenizer

        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ",", ".", *WORDS, *letters, *[f"##{c}" for c in letters]]
        return BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    from transformers import XLMRobertaTokenizer

    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0), (",", -2.0)]
    return XLMRobertaTokenizer(vocab=pieces + [("▁" + w, -1.0) for w in WORDS] + [(c, -5.0) for c in letters])


def _hf_model(kind: str, masked_lm: bool = False) -> Any:
    from transformers import BertConfig, BertForMaskedLM, BertModel, XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(0 if kind == "bert" else 1)
    shape = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=MAX_POS)
    if kind == "xlmr":
        return XLMRobertaModel(XLMRobertaConfig(**shape, pad_token_id=1, bos_token_id=0, eos_token_id=2)).eval()
    if masked_lm:
        return BertForMaskedLM(BertConfig(**shape)).eval()
    return BertModel(BertConfig(**shape)).eval()


def _save_st_folder(model: Any, tokenizer: Any, folder: str, pooling: str, normalize: bool) -> str:
    """A sentence-transformers folder: the transformer at the root, 1_Pooling, and 2_Normalize if asked."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(folder, "2_Normalize"), exist_ok=True)
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(folder, "1_Pooling"), exist_ok=True)
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "cls",
                   "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False}, f)
    return folder


def _reference(model: Any, ids: list[int], pooling: str, normalize: bool) -> np.ndarray:
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    v = h[0] if pooling == "cls" else h.mean(0)
    return (torch.nn.functional.normalize(v, dim=0) if normalize else v).numpy()


CASES = [("bert", "cls", True), ("bert", "mean", False), ("xlmr", "cls", True), ("xlmr", "mean", True),
         ("xlmr", "cls", False)]


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {kind: _hf_model(kind) for kind in ("bert", "xlmr")}


@pytest.fixture(scope="module")
def folders(models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, str]:
    return {case: _save_st_folder(models[case[0]], _tokenizer(case[0]), str(tmp_path_factory.mktemp("_".join(
        map(str, case)))), case[1], case[2]) for case in CASES}


def _scheduler(folder: str, **kw: Any) -> Scheduler:
    args = dict(model_path=folder, device="cpu", dtype="float32", skip_tokenizer_init=True, random_seed=0)
    return Scheduler(ServerArgs(**{**args, **kw}), port_args={})


def _embed(s: Scheduler, prompts: list[list[int]], pooling: str) -> tuple[list[Any], list[dict]]:
    """Submit all prompts, run the scheduler until idle; (each prompt's embedding or abort, its meta_info)."""
    base = s.num_generate_received
    rids = [f"r{base + i}" for i in range(len(prompts))]
    s.process_input_requests([io.TokenizedGenerateReqInput(
        rid=rid, input_text=None, input_ids=p, sampling_params=SamplingParams.from_dict({"max_new_tokens": 0}),
        pooling=pooling) for rid, p in zip(rids, prompts, strict=True)])
    while s.step() or not s.is_idle():
        pass
    out: dict[str, Any] = {}
    for msg in s.outbox:
        if isinstance(msg, io.BatchTokenIDOut):
            for rid, fin, meta in zip(msg.rids, msg.finished_reasons, msg.meta_infos, strict=True):
                out[rid] = (meta.get("embedding", fin), meta)
    s.outbox.clear()
    assert s.check_memory()
    return [out[r][0] for r in rids], [out[r][1] for r in rids]


def _record_batches(s: Scheduler) -> list[list[int]]:
    """The extend lengths of every forward the encoder runs from now on."""
    model, seen = s.worker.model_runner.model, []
    encode = model.encode

    def spy(input_ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
        seen.append(list(lens))
        return encode(input_ids, lens)

    model.encode = spy
    return seen


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_matches_transformers(case: tuple, models: dict[str, Any], folders: dict[tuple, str]) -> None:
    kind, pooling, normalize = case
    tok, model = _tokenizer(kind), models[kind]
    s = _scheduler(folders[case])
    assert s.server_args.is_embedding and s.server_args.disable_radix_cache and s.chunk_size is None
    batches = _record_batches(s)
    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "paris", "zzz, capital of france"]
    prompts = [tok.encode(t) for t in texts]  # with the special tokens: [CLS] ... [SEP] / <s> ... </s>
    assert all(p[0] == tok.cls_token_id and p[-1] == tok.sep_token_id for p in prompts)
    (one,), _ = _embed(s, prompts[:1], pooling)
    np.testing.assert_allclose(one, _reference(model, prompts[0], pooling, normalize), atol=ATOL)
    assert (abs(np.linalg.norm(one) - 1) < 1e-5) == normalize
    many, metas = _embed(s, prompts, pooling)  # one forward of four lengths: padding must not leak between them
    assert batches[-1] == [len(p) for p in prompts]
    for p, got, meta in zip(prompts, many, metas, strict=True):
        np.testing.assert_allclose(got, _reference(model, p, pooling, normalize), atol=ATOL)
        assert meta["cached_tokens"] == 0
    # a long input among short ones: attention one request at a time (padding would more than double the rows)
    skewed = [prompts[2], [tok.cls_token_id] + [7 + i % 20 for i in range(34)], prompts[0], prompts[2]]
    for p, got in zip(skewed, _embed(s, skewed, pooling)[0], strict=True):
        np.testing.assert_allclose(got, _reference(model, p, pooling, normalize), atol=ATOL)
    assert batches[-1] == [len(p) for p in skewed]


def test_shared_prefix_and_full_length(models: dict[str, Any], folders: dict[tuple, str]) -> None:
    """A prompt extending an earlier one is computed whole (its prefix's hidden states depend on what follows), as
    is a repeat; a prompt that fills the position table matches transformers; one token more is refused (400).
    XLM-R runs under overlap scheduling (CUDA's default)."""
    for case in (("bert", "cls", True), ("xlmr", "mean", True)):
        kind, pooling, normalize = case
        s = _scheduler(folders[case], enable_overlap_schedule=kind == "xlmr")
        first = [_tokenizer(kind).cls_token_id] + [7 + i % 20 for i in range(12)]
        longer = first + [30, 31, 32, 33]
        (a,), _ = _embed(s, [first], pooling)
        (b, c), metas = _embed(s, [longer, first], pooling)
        assert [m["cached_tokens"] for m in metas] == [0, 0]
        np.testing.assert_allclose(b, _reference(models[kind], longer, pooling, normalize), atol=ATOL)
        np.testing.assert_allclose(c, a, atol=ATOL)
        limit = MAX_POS - (2 if kind == "xlmr" else 0)
        assert s.context_len == limit
        full = [5 + i % 40 for i in range(limit)]
        (got,), _ = _embed(s, [full], pooling)
        np.testing.assert_allclose(got, _reference(models[kind], full, pooling, normalize), atol=ATOL)
        (refused,), _ = _embed(s, [full + [5]], pooling)
        assert refused["type"] == "abort" and refused["status_code"] == 400 and "context length" in refused["message"]


def test_masked_lm_checkpoint_and_warmup(tmp_path: Any) -> None:
    """BertForMaskedLM's weights (under `bert.`, with its MLM head) load as the encoder; the start-up warm-up runs
    pooled prefills only (no decode) and leaves the scheduler idle with its pools whole."""
    mlm = _hf_model("bert", masked_lm=True)
    folder = _save_st_folder(mlm, _tokenizer("bert"), str(tmp_path), "mean", True)
    assert ModelConfig(folder).architectures == ["BertForMaskedLM"]
    s = _scheduler(folder)
    s.warmup()
    assert s.is_idle() and s.check_memory()
    ids = [2, 9, 10, 11, 12, 3]
    (got,), _ = _embed(s, [ids], "mean")
    np.testing.assert_allclose(got, _reference(mlm.bert, ids, "mean", True), atol=ATOL)


def test_encoder_configuration(folders: dict[tuple, str], tmp_path: Any) -> None:
    cfg = ModelConfig(folders["xlmr", "cls", True])
    assert cfg.is_encoder and cfg.context_len == MAX_POS - 2
    assert ModelConfig(folders["xlmr", "cls", True], context_length=4096).context_len == MAX_POS - 2
    args = ServerArgs(model_path=cfg.model_path, device="cpu")
    apply_encoder_args(args, cfg)
    assert args.is_embedding and args.disable_radix_cache and args.chunk_size is None and args.disable_cuda_graph
    with pytest.raises(ValueError, match="encoder"):
        apply_encoder_args(ServerArgs(model_path=cfg.model_path, device="cpu", speculative_algorithm="ngram"), cfg)
    # pooling and normalisation from the sentence-transformers folder; CLS only for encoders
    assert model_pooling(folders["bert", "cls", True], None, encoder=True) == "cls"
    assert model_pooling(folders["bert", "mean", False], None, encoder=True) == "mean"
    with pytest.raises(ValueError, match="encoder"):
        model_pooling(folders["bert", "cls", True], None, encoder=False)
    assert embedding_normalize(folders["bert", "cls", True]) and not embedding_normalize(folders["bert", "mean", False])
    assert embedding_normalize(str(tmp_path))  # no modules.json: normalised (as before)
    assert ServerArgs(model_path=cfg.model_path, is_embedding=True, pooling_method="cls").pooling_method == "cls"


@pytest.fixture(scope="module")
def bert_server(folders: dict[tuple, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real server on the BERT folder (CLS pooling, normalised), started without --is-embedding: the model's
    being an encoder turns embeddings on."""
    folder, port = folders["bert", "cls", True], free_port()
    log_path = tmp_path_factory.mktemp("bert_server") / "server.log"
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
    assert "is an encoder-only model" in log_path.read_text()


@pytest.mark.integration
def test_server_embeddings(bert_server: str, models: dict[str, Any]) -> None:
    tok, model = _tokenizer("bert"), models["bert"]
    texts = ["hello world", "the quick brown fox jumps over the lazy dog"]
    with httpx.Client(base_url=bert_server, timeout=120) as http:
        r = http.post("/v1/embeddings", json={"input": texts, "encoding_format": "float"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in texts)
        for t, d in zip(texts, body["data"], strict=True):
            np.testing.assert_allclose(d["embedding"], _reference(model, tok.encode(t), "cls", True), atol=1e-4)
        ids = tok.encode(texts[1])
        r = http.post("/v1/embeddings", json={"input": ids[:5], "encoding_format": "float"})
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], _reference(model, ids[:5], "cls", True),
                                   atol=1e-4)
        r = http.post("/v1/embeddings", json={"input": [5] * (MAX_POS + 1)})
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text
        assert http.post("/v1/embeddings", json={"input": [5] * MAX_POS}).status_code == 200
        r = http.post("/v1/completions", json={"prompt": "hello"})
        assert r.status_code == 400
