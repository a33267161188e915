"""The offline Engine and the process launcher shared with the HTTP server.

launch_subprocesses() starts the detokenizer and the scheduler (one per TP rank) together, loads this process's
tokenizer meanwhile, waits until they are ready, and returns a TokenizerManager living in this process. The Engine
wraps that manager with a private asyncio loop so that plain Python code can call generate(), and code running in
its own event loop can await async_generate()."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixserve.configs.encoder import apply_encoder_args, is_classifier
from radixserve.configs.hybrid import apply_hybrid_args
from radixserve.configs.model_config import ModelConfig
from radixserve.managers import io_struct as io
from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)


class EngineProcesses:
    """The child processes behind one TokenizerManager."""

    def __init__(self, procs: list[mp.Process], ipc_dir: str) -> None:
        self.procs = procs
        self.ipc_dir = ipc_dir

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def dead(self) -> list[str]:
        """One sentence per child that has exited: which process, and its exit code or signal."""
        out = []
        for p in self.procs:
            if p.is_alive():
                continue
            code = p.exitcode
            if code is not None and code < 0:
                try:
                    how = f"was killed by {signal.Signals(-code).name}"
                except ValueError:
                    how = f"was killed by signal {-code}"
            else:
                how = f"exited with code {code}"
            out.append(f"the {p.name.removeprefix('radixserve-')} process (pid {p.pid}) {how}")
        return out

    def shutdown(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def resolve_model(server_args: ServerArgs) -> ModelConfig:
    """Resolve the model once in the parent (this converts the embedded model if needed), so children reuse it."""
    cfg = ModelConfig(server_args.model_path, context_length=server_args.context_length,
                      load_format=server_args.load_format, trust_remote_code=server_args.trust_remote_code)
    server_args.model_path = cfg.model_path
    apply_encoder_args(server_args, cfg)  # an encoder (BERT, XLM-R): embeddings, no radix cache or chunking
    apply_hybrid_args(server_args, cfg)  # recurrent-state layers (Qwen3-Next, Qwen3.5, Granite 4.0, Nemotron-H)
    explicit = server_args.tokenizer_path is not None
    if not explicit:
        server_args.tokenizer_path = cfg.tokenizer_path
    if explicit and not server_args.skip_tokenizer_init and not _has_tokenizer(server_args.tokenizer_path):
        raise ValueError(f"--tokenizer-path {server_args.tokenizer_path!r} holds no tokenizer (tokenizer.json, "
                         "tokenizer_config.json, tokenizer.model or vocab.json, or a .gguf file)")
    if not server_args.skip_tokenizer_init and not _has_tokenizer(server_args.tokenizer_path):
        # e.g. a config-only folder served with --load-format dummy: token ids in, token ids out
        logger.warning("no tokenizer in %s: serving token ids only (as with --skip-tokenizer-init)",
                       server_args.tokenizer_path)
        server_args.skip_tokenizer_init = True
    return cfg


def _has_tokenizer(path: str | None) -> bool:
    if path is None:
        return False
    if path.endswith(".gguf"):
        return True
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any(os.path.exists(os.path.join(path, n)) for n in names)


def _wait_ready(conn: Any, proc: mp.Process, what: str, timeout: float = 1800.0) -> dict[str, Any]:
    waited = 0.0
    while not conn.poll(1.0):
        waited += 1.0
        if not proc.is_alive():
            raise RuntimeError(f"the {what} process died during start-up (exit code {proc.exitcode})")
        if waited > timeout:
            raise RuntimeError(f"the {what} process did not start within {timeout:.0f} s")
    msg = conn.recv()
    if msg.get("status") != "ready":
        raise RuntimeError(f"the {what} process failed to start: {msg.get('message')}")
    return msg


def launch_subprocesses(server_args: ServerArgs) -> tuple[TokenizerManager, EngineProcesses]:
    from radixserve.managers.detokenizer_manager import run_detokenizer_process
    from radixserve.managers.scheduler import run_scheduler_process
    from radixserve.managers.tokenizer_utils import get_tokenizer

    model_config = resolve_model(server_args)
    ipc_dir = server_args.make_ipc_dir()
    port_args = {name: f"ipc://{os.path.join(ipc_dir, name)}"
                 for name in ("scheduler_input", "detokenizer_input", "tokenizer_input")}
    if server_args.tp_size > 1 or server_args.dp_size > 1:
        from radixserve.managers.dp_launcher import require_head_node

        require_head_node(server_args)  # before any process starts
    ctx = mp.get_context("spawn")
    procs: list[mp.Process] = []
    tokenizer_path = None if server_args.skip_tokenizer_init else server_args.tokenizer_path
    # Everything starts at once: the detokenizer, the scheduler(s) and, on a thread here, this process's own
    # tokenizer (each of the three imports transformers and loads the tokenizer: seconds, serial before).
    loader = ThreadPoolExecutor(1, thread_name_prefix="radixserve-tokenizer-load")
    pending = loader.submit(get_tokenizer, tokenizer_path, server_args.trust_remote_code) if tokenizer_path else None
    try:
        det_reader, det_writer = ctx.Pipe(duplex=False)
        detokenizer = ctx.Process(target=run_detokenizer_process, args=(server_args, port_args, tokenizer_path,
                                                                        det_writer),
                                  daemon=True, name="radixserve-detokenizer")
        detokenizer.start()
        procs.append(detokenizer)
        if server_args.tp_size > 1 or server_args.dp_size > 1:
            from radixserve.managers.dp_launcher import launch_parallel_schedulers

            sched_infos = launch_parallel_schedulers(server_args, port_args, ctx, procs)
            info = sched_infos[0]
        else:
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=run_scheduler_process, args=(server_args, port_args, 0, server_args.base_gpu_id,
                                                                   writer), daemon=True, name="radixserve-scheduler")
            proc.start()
            procs.append(proc)
            info = _wait_ready(reader, proc, "scheduler")["info"]
        _wait_ready(det_reader, detokenizer, "detokenizer")
        tokenizer = pending.result() if pending is not None else None
    except BaseException:
        EngineProcesses(procs, ipc_dir).shutdown()
        raise
    finally:
        loader.shutdown(wait=False)
    if tokenizer is not None and server_args.chat_template is not None:
        with open(server_args.chat_template, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()  # used by /v1/chat/completions
    tm = TokenizerManager(server_args, port_args, tokenizer, info.context_len, info.vocab_size, info)
    tm.model_config = model_config
    if server_args.sampling_defaults == "model":
        from radixserve.sampling.model_defaults import load_sampling_defaults

        tm.sampling_defaults = load_sampling_defaults(server_args.model_path)
        if tm.sampling_defaults:
            logger.info("sampling defaults from the model's generation_config.json: %s",
                        ", ".join(f"{k}={v}" for k, v in tm.sampling_defaults.items()))
    tm.processes = EngineProcesses(procs, ipc_dir)
    return tm, tm.processes


class Engine:
    """Offline inference with the same processes as the server:

        engine = Engine(model_path=None)           # the embedded SmolLM2-135M-Instruct
        out = engine.generate("Hi", {"max_new_tokens": 16, "temperature": 0})
        engine.shutdown()

    With is_embedding=True, encode() gives embeddings instead (generate() is then refused).
    """

    def __init__(self, **kwargs: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        logging.basicConfig(level=self.server_args.log_level.upper(),
                            format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
        self.tokenizer_manager, self.processes = launch_subprocesses(self.server_args)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="radixserve-engine-loop")
        self._thread.start()
        self._closed = False
        atexit.register(self.shutdown)

    # ---------------------------------------------------------------- generate
    def _request(self, prompt: Any, sampling_params: Any, input_ids: Any, stream: bool, return_logprob: Any,
                 logprob_start_len: Any, top_logprobs_num: Any, rid: Any, lora_path: Any = None) -> io.GenerateReqInput:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        if self.server_args.is_embedding:
            raise ValueError("this engine serves embeddings (is_embedding=True): use encode()")
        return io.GenerateReqInput(text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
                                   stream=stream, return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                   top_logprobs_num=top_logprobs_num, lora_path=lora_path)

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                 return_logprob: bool | list[bool] = False, logprob_start_len: int | list[int] = -1,
                 top_logprobs_num: int | list[int] = 0, rid: str | list[str] | None = None,
                 lora_path: str | list[str | None] | None = None
                 ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """`lora_path`: the LoRA adapter's name (one per prompt for a batch); None: the base model."""
        obj = self._request(prompt, sampling_params, input_ids, stream, return_logprob, logprob_start_len,
                            top_logprobs_num, rid, lora_path)
        return self._stream(obj) if stream else self._submit(obj).result()

    def _submit(self, obj: io.GenerateReqInput) -> concurrent.futures.Future:
        """Run the request on the engine's loop; the future's result is its output, or the batch's in order."""
        async def collect() -> dict[str, Any] | list[dict[str, Any]]:
            outs = [o async for o in self.tokenizer_manager.generate_request(obj)]
            if outs and "index" not in outs[0]:
                return outs[0]
            outs.sort(key=lambda o: o.pop("index"))
            return outs

        return asyncio.run_coroutine_threadsafe(collect(), self.loop)

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                             return_logprob: bool | list[bool] = False, logprob_start_len: int | list[int] = -1,
                             top_logprobs_num: int | list[int] = 0, rid: str | list[str] | None = None,
                             lora_path: str | list[str | None] | None = None
                             ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """generate() for callers in their own event loop (SGLang's Engine.async_generate): awaits the result, or
        with stream=True returns an async iterator of the chunks. The requests run on the engine's loop."""
        obj = self._request(prompt, sampling_params, input_ids, stream, return_logprob, logprob_start_len,
                            top_logprobs_num, rid, lora_path)
        return self._async_stream(obj) if stream else await asyncio.wrap_future(self._submit(obj))

    async def _async_stream(self, obj: io.GenerateReqInput) -> AsyncIterator[dict[str, Any]]:
        agen = self.tokenizer_manager.generate_request(obj)
        try:
            while True:
                try:
                    yield await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(agen.__anext__(), self.loop))
                except StopAsyncIteration:
                    return
        finally:  # the caller stopped early (or finished): closing the generator aborts an unfinished request
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(agen.aclose(), self.loop))

    def encode(self, prompt: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None,
               rid: str | list[str] | None = None, lora_path: str | list[str | None] | None = None
               ) -> dict[str, Any] | list[dict[str, Any]]:
        """Embeddings from an engine started with is_embedding=True, as POST /encode gives them: per input
        {"embedding": [...] (pooled as --pooling-method or the model folder says, L2-normalised unless its
        modules.json lists no Normalize), "meta_info":
        {...}}; a list for a batch (a list of texts or of token-id lists)."""
        if self._closed:
            raise RuntimeError("the engine is shut down")
        if not self.server_args.is_embedding:
            raise ValueError("encode() needs an engine started with is_embedding=True")
        if (prompt is None) == (input_ids is None):
            raise ValueError("encode(): give exactly one of prompt and input_ids")
        if "_pooling" not in self.__dict__:
            from radixserve.entrypoints.openai.serving_embedding import model_pooling

            mc = self.tokenizer_manager.model_config  # a cross-encoder: its head's raw scores on the first token
            self._pooling = "cls" if is_classifier(mc.architectures) else model_pooling(
                self.server_args.model_path, self.server_args.pooling_method, getattr(mc, "is_encoder", False))
        obj = io.GenerateReqInput(text=prompt, input_ids=input_ids, rid=rid, lora_path=lora_path,
                                  pooling=self._pooling)

        async def collect() -> list[dict[str, Any]]:
            return [o async for o in self.tokenizer_manager.generate_request(obj)]

        outs = asyncio.run_coroutine_threadsafe(collect(), self.loop).result()
        outs.sort(key=lambda o: o.get("index", 0))
        result = []
        for o in outs:
            meta = dict(o["meta_info"])
            if "embedding" not in meta:  # aborted (the engine is shutting down, or abort_request)
                reason = meta.get("finish_reason") or {}
                raise RuntimeError(f"the request did not finish: {reason.get('message', reason)}")
            result.append({"embedding": meta.pop("embedding"), "meta_info": meta})
        return result if obj.is_batch() else result[0]

    def rerank(self, query: str, documents: list[str], top_n: int | None = None,
               return_documents: bool = True) -> list[dict[str, Any]]:
        """What POST /v1/rerank's `results` gives, from an engine on a cross-encoder (bge-reranker): per document
        {"index", "relevance_score" (sigmoid of the head's logit), "document"?: {"text"}}, best first, the first
        `top_n`. ValueError for an empty query or list, a pair over the context, a model that is not one."""
        from radixserve.entrypoints.openai.serving_score import ranked, rerank_pairs

        return ranked(self._pair_scores(rerank_pairs(query, list(documents))), list(documents), top_n,
                      return_documents)

    def score(self, text_1: str | list[str], text_2: str | list[str]) -> list[float]:
        """POST /v1/score's scores: one text against a list (either side) or two lists paired item by item."""
        from radixserve.entrypoints.openai.serving_score import score_pairs

        return self._pair_scores(score_pairs(text_1, text_2))

    def _pair_scores(self, pairs: list[tuple[str, str]]) -> list[float]:
        from radixserve.entrypoints.openai.serving_score import check_num_labels, check_pair_count, relevance_scores

        tm = self.tokenizer_manager
        if not is_classifier(tm.model_config.architectures):
            raise ValueError(f"rerank() / score() need a cross-encoder model (*ForSequenceClassification); this "
                             f"engine serves a {tm.model_config.architectures[0]}")
        check_num_labels(int(getattr(tm.model_config.hf_config, "num_labels", 1)))
        check_pair_count(len(pairs), "documents")
        try:
            ids = [tm.tokenize(a, text_pair=b) for a, b in pairs]
        except RequestError as e:
            raise ValueError(str(e)) from None
        for i, x in enumerate(ids):
            if len(x) > tm.context_len:
                raise ValueError(f"pair {i} has {len(x)} tokens; the model's context length is {tm.context_len}")
        return relevance_scores([o["embedding"] for o in self.encode(input_ids=ids)])

    def _stream(self, obj: io.GenerateReqInput) -> Iterator[dict[str, Any]]:
        agen = self.tokenizer_manager.generate_request(obj)
        try:
            while True:
                try:
                    yield asyncio.run_coroutine_threadsafe(agen.__anext__(), self.loop).result()
                except StopAsyncIteration:
                    return
        finally:
            asyncio.run_coroutine_threadsafe(agen.aclose(), self.loop).result()

    # ---------------------------------------------------------------- management
    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def abort_request(self, rid: str) -> None:
        """Abort the request `rid` (with n > 1: its samples), as POST /abort_request does."""
        # the manager's sockets belong to the engine's event loop thread
        self.loop.call_soon_threadsafe(self.tokenizer_manager.abort_named, rid)

    def flush_cache(self) -> bool:
        return self._run(self.tokenizer_manager.flush_cache())

    def get_internal_state(self) -> dict[str, Any]:
        return self._run(self.tokenizer_manager.get_internal_state())

    def get_server_info(self) -> dict[str, Any]:
        """What GET /get_server_info gives for a server: the arguments in force (the API key masked), the
        scheduler's facts (e.g. max_total_num_tokens), the version and the scheduler's internal state."""
        import radixserve

        args = dataclasses.asdict(self.server_args)
        if args.get("api_key"):
            args["api_key"] = "***"
        info = self.tokenizer_manager.scheduler_info
        return {**args, "scheduler_info": dataclasses.asdict(info) if dataclasses.is_dataclass(info) else {},
                "version": radixserve.__version__, "internal_states": [self.get_internal_state()]}

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> str:
        """Serve the PEFT adapter folder `lora_path` as `lora_name` (RequestError when it cannot be)."""
        return self._run(self.tokenizer_manager.load_lora_adapter(lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> str:
        """Stop serving `lora_name`; returns once its running requests have ended and it is gone."""
        return self._run(self.tokenizer_manager.unload_lora_adapter(lora_name))

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.processes.shutdown()

        async def cancel_tasks() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        try:
            asyncio.run_coroutine_threadsafe(cancel_tasks(), self.loop).result(timeout=5)
        except Exception:  # the loop may already be gone at interpreter exit
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


__all__ = ["Engine", "RequestError", "launch_subprocesses"]
