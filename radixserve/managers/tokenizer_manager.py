"""TokenizerManager: lives in the caller's process (HTTP server or Engine). Tokenizes and validates requests, sends
them to the scheduler, and gathers the detokenizer's text back into per-request state, on asyncio."""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import functools
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq
import zmq.asyncio

from radixserve.managers import io_struct as io
from radixserve.sampling.model_defaults import apply_defaults
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from radixserve.utils import get_zmq_socket, log_safe

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine refuses; `status_code` is the HTTP status it maps to."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.param = param
        self.code = code  # an error code for the HTTP layer (None: derived from the status)


@dataclasses.dataclass
class ReqState:
    text: str = ""
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    event: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    created: float = dataclasses.field(default_factory=time.time)
    first_token_time: float | None = None
    log_metrics: bool = True  # reported to the metrics hooks (the server's own requests are not)
    stream: bool = True  # False: the scheduler holds the tokens until the end (its stamp times the first one)


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: dict[str, str], tokenizer: Any, context_len: int,
                 vocab_size: int, scheduler_info: io.SchedulerInfo | None = None) -> None:
        self.server_args = server_args
        self.port_args = port_args
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.scheduler_info = scheduler_info
        self.rid_to_state: dict[str, ReqState] = {}
        # an n > 1 request's samples (`rid-0`, ...) and shared prefill (`rid-0-prefill`) -> the request's rid
        self.rid_parent: dict[str, str] = {}
        # samples aborted before they were sent (while their prompt was prefilled once for them) -> the message
        self.unsent_aborts: dict[str, str] = {}
        self.pending_control: dict[int, asyncio.Future] = {}  # control requests by seq, answered by their replies
        self._control_seq = itertools.count(1)
        self.ctx = zmq.asyncio.Context(2)
        self.send_to_scheduler = get_zmq_socket(self.ctx, zmq.PUSH, port_args["scheduler_input"], bind=False)
        self.recv_from_detokenizer = get_zmq_socket(self.ctx, zmq.PULL, port_args["tokenizer_input"], bind=True)
        self._loop_task: asyncio.Task | None = None
        self.metrics: Any = None  # set by the HTTP server when --enable-metrics
        self.processes: Any = None  # the EngineProcesses behind this manager (checked while requests wait)
        self.num_queued = 0
        # tokenization runs off the event loop (HF tokenizers release the GIL while encoding); one thread, since a
        # fast tokenizer must not be used by two threads at once
        self.sampling_defaults: dict[str, Any] = {}  # from the model's generation_config.json (launch sets it)
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="radixserve-tokenize")
        self._max_token_chars: int | None = None
        self._gen_tokens = 0  # generated tokens seen so far, sampled for gen_throughput()
        self._gen_samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=16)
        # LoRA adapters served now (names); None when the server serves none
        self.lora_names: set[str] | None = {n for n, _ in server_args.lora_path_pairs()} \
            if server_args.enable_lora else None

    # ---------------------------------------------------------------- receive loop
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._handle_loop())

    async def _handle_loop(self) -> None:
        while True:
            obj = await self.recv_from_detokenizer.recv_pyobj()
            try:
                if isinstance(obj, io.BatchStrOut):
                    self._handle_batch_out(obj)
                else:
                    fut = self.pending_control.pop(getattr(obj, "seq", 0), None)
                    if fut is not None and not fut.done():
                        fut.set_result(obj)
                    else:  # its caller gave up waiting: keep the adapter list as the scheduler has it
                        self._late_control_reply(obj)
            except Exception:
                logger.exception("tokenizer manager failed to handle %s", type(obj).__name__)

    def _handle_batch_out(self, out: io.BatchStrOut) -> None:
        now = time.time()
        for i, rid in enumerate(out.rids):
            state = self.rid_to_state.get(rid)
            if state is None:
                continue
            state.text += out.text_deltas[i]
            state.output_ids.extend(out.new_token_ids[i])
            meta = out.meta_infos[i]
            timing = meta.pop("_timing", None)  # the scheduler's stamps of this request's first output
            for key in ("output_token_logprobs", "output_top_logprobs"):
                if key in meta:
                    state.meta.setdefault(key, []).extend(meta[key])
            for key, val in meta.items():
                if key not in ("output_token_logprobs", "output_top_logprobs"):
                    state.meta[key] = val
            metrics = self.metrics if state.log_metrics else None
            if state.first_token_time is None and out.new_token_ids[i]:
                state.first_token_time = now
                if metrics is not None:  # a non-streamed answer's first output holds all its tokens, and
                    # its first token was made when the scheduler stamped it, not when the answer arrived
                    first = timing[2] if timing is not None and not state.stream else now
                    metrics.observe_ttft(first - state.created, len(out.new_token_ids[i]))
                    if timing is not None:
                        metrics.observe_ttft_stages(state.created, timing, first)
            elif metrics is not None and out.new_token_ids[i]:
                metrics.observe_decode(state, now, len(out.new_token_ids[i]))
            self._gen_tokens += len(out.new_token_ids[i])
            if out.finished_reasons[i] is not None:
                state.finished = True
                state.meta["finish_reason"] = out.finished_reasons[i]
            state.event.set()

    def gen_throughput(self) -> float:
        """Generated tokens per second over the last ~10 s (SGLang's `last_gen_throughput`)."""
        now = time.monotonic()
        if not self._gen_samples or now - self._gen_samples[-1][0] >= 1.0:
            self._gen_samples.append((now, self._gen_tokens))
        window = [(t, c) for t, c in self._gen_samples if now - t <= 10.0]
        if not window or now - window[0][0] < 0.5:
            return 0.0
        return (self._gen_tokens - window[0][1]) / (now - window[0][0])

    # ---------------------------------------------------------------- requests
    @property
    def max_prompt_chars(self) -> int:
        """No prompt of more characters fits the context: a token is at most this many characters long."""
        if self._max_token_chars is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._max_token_chars = max((len(k) for k in vocab), default=0) or 1024
        return self.context_len * self._max_token_chars

    def check_text_length(self, num_chars: int, param: str = "text") -> None:
        """A cheap check before tokenizing: text too long for the context whatever its tokens is a 400 at once."""
        if self.tokenizer is not None and num_chars > self.max_prompt_chars:
            raise RequestError(f"This model's maximum context length is {self.context_len} tokens; a text of "
                               f"{num_chars} characters has more tokens than that", 400, param)

    def tokenize(self, text: str, **kwargs: Any) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("this server has no tokenizer (--skip-tokenizer-init, or none in the model folder): "
                               "send input_ids", 400, "text")
        self.check_text_length(len(text))
        return self.tokenizer.encode(text, **kwargs)

    async def tokenize_async(self, text: str, **kwargs: Any) -> list[int]:
        """`tokenize` on the tokenizer thread, so a long text does not stall the event loop (other streams,
        /health)."""
        if self.tokenizer is None or len(text) < 2048:
            return self.tokenize(text, **kwargs)
        self.check_text_length(len(text))
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, functools.partial(self.tokenizer.encode, text, **kwargs))

    def _validate_ids(self, ids: list[int], param: str = "input_ids", prefill_only: bool = False) -> None:
        if not ids:
            raise RequestError("the prompt is empty", 400, param)
        if any((not isinstance(t, int)) or isinstance(t, bool) for t in ids):
            raise RequestError("input_ids must be a list of integers", 400, param)
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise RequestError(f"input_ids must be in [0, {self.vocab_size}); got {min(ids)}..{max(ids)}", 400,
                               param)
        if len(ids) > self.context_len or (len(ids) == self.context_len and not prefill_only):
            raise RequestError(f"the prompt has {len(ids)} tokens; the model's context length is "
                               f"{self.context_len}", 400, param)

    def make_sampling_params(self, d: dict[str, Any] | None) -> SamplingParams:
        d = apply_defaults(dict(d or {}), getattr(self, "sampling_defaults", {}))
        if isinstance(d.get("json_schema"), dict | bool):  # a schema given as a JSON object, not as text
            d["json_schema"] = json.dumps(d["json_schema"])
        try:
            sp = SamplingParams.from_dict(d)
            sp.normalize(self.tokenizer)
            sp.verify(self.vocab_size)
        except (ValueError, TypeError) as e:
            raise RequestError(str(e), 400, "sampling_params") from e
        if self.tokenizer is None and sp.stop:
            raise RequestError("stop: stop strings need the tokenizer, and this server runs with "
                               "--skip-tokenizer-init; use stop_token_ids", 400, "sampling_params")
        self.check_grammar(sp)
        return sp

    def check_grammar(self, sp: SamplingParams) -> None:
        """A constrained request is checked here (parsed, not compiled) so that a bad schema, regex or EBNF is a
        400 before anything is queued or streamed; the scheduler compiles it."""
        grammar = sp.grammar
        if grammar is None:
            return
        kind, text = grammar
        backend = self.server_args.grammar_backend
        from radixserve.constrained import GrammarError, is_backend_available, validate_grammar

        if backend == "none" or self.tokenizer is None or not is_backend_available(backend):
            why = "--grammar-backend none" if backend == "none" else (
                "--skip-tokenizer-init" if self.tokenizer is None else f"{backend} is not installed")
            raise RequestError(f"{kind}: structured output is not available on this server ({why})", 400,
                               "sampling_params")
        try:
            validate_grammar(backend, kind, text)
        except GrammarError as e:
            raise RequestError(str(e), 400, "sampling_params") from None

    def normalize(self, obj: io.GenerateReqInput,
                  token_ids: list[list[int]] | None = None) -> list[io.TokenizedGenerateReqInput]:
        """Split a (possibly batched) request into tokenized single requests, all validated before any is sent.
        `token_ids`: the text prompts already tokenized (by `pretokenize`), one list per prompt."""
        if (obj.text is None) == (obj.input_ids is None):
            raise RequestError("give exactly one of text and input_ids", 400, "text")
        batch = obj.is_batch()
        prompts: list[Any] = (obj.text if obj.text is not None else obj.input_ids) if batch else \
            [obj.text if obj.text is not None else obj.input_ids]
        if batch and not prompts:
            raise RequestError("the batch is empty", 400, "text")
        n_prompts = len(prompts)

        def per(value: Any, name: str) -> list[Any]:
            if isinstance(value, list):  # one per prompt (a single prompt may have its value in a list of one)
                if len(value) != n_prompts:
                    raise RequestError(f"{name} is a list of {len(value)} but there are {n_prompts} prompts", 400,
                                       name)
                return value
            return [value] * n_prompts

        sps = per(obj.sampling_params, "sampling_params") if isinstance(obj.sampling_params, list) \
            else [obj.sampling_params] * n_prompts
        rids = per(obj.rid, "rid") if obj.rid is not None else [None] * n_prompts
        out = []
        for i, p in enumerate(prompts):
            if obj.text is not None:
                if not isinstance(p, str):
                    raise RequestError("text must be a string or a list of strings", 400, "text")
                if not p:
                    raise RequestError("the prompt is empty", 400, "text")
                ids = token_ids[i] if token_ids is not None else self.tokenize(p)
                text = p
            else:
                if not isinstance(p, list):
                    raise RequestError("input_ids must be a list of integers or a list of such lists", 400,
                                       "input_ids")
                ids, text = p, None
            self._validate_ids(ids, prefill_only=obj.pooling is not None)  # (an embedding may fill the context)
            sp = self.make_sampling_params(sps[i] if obj.pooling is None else {"max_new_tokens": 0})
            if len(ids) + sp.max_new_tokens > self.context_len:
                # one rule for every API: a requested length that cannot fit is a 400; a default one is clamped
                # (the request then ends with finish_reason "length")
                if isinstance(sps[i], dict) and sps[i].get("max_new_tokens") is not None:
                    raise RequestError(f"max_new_tokens: this model's maximum context length is {self.context_len} "
                                       f"tokens; the prompt has {len(ids)} and max_new_tokens is "
                                       f"{sp.max_new_tokens}", 400, "sampling_params")
                sp.max_new_tokens = self.context_len - len(ids)
            logprob_start = per(obj.logprob_start_len, "logprob_start_len")[i]
            top_n = per(obj.top_logprobs_num, "top_logprobs_num")[i]
            ret_lp = per(obj.return_logprob, "return_logprob")[i]
            if not isinstance(top_n, int) or not 0 <= top_n <= 20:
                raise RequestError("top_logprobs_num must be an integer in [0, 20]", 400, "top_logprobs_num")
            if not isinstance(logprob_start, int) or not -1 <= logprob_start < len(ids):
                raise RequestError(f"logprob_start_len must be -1 (no prompt logprobs) or an integer in [0, the "
                                   f"prompt length {len(ids)})", 400, "logprob_start_len")
            lora_id = self.check_lora(per(obj.lora_path, "lora_path")[i])
            base_rid = rids[i] or uuid.uuid4().hex
            for j in range(sp.n):
                sp_j = sp if sp.n == 1 else copy.copy(sp)
                if sp.n > 1 and sp.seed is not None:
                    sp_j.seed = sp.seed + j
                out.append(io.TokenizedGenerateReqInput(
                    rid=base_rid if sp.n == 1 else f"{base_rid}-{j}", input_text=text, input_ids=list(ids),
                    sampling_params=sp_j, stream=obj.stream, return_logprob=bool(ret_lp),
                    logprob_start_len=logprob_start if ret_lp else -1, top_logprobs_num=top_n if ret_lp else 0,
                    lora_id=lora_id, pooling=obj.pooling, log_metrics=obj.log_metrics))
        seen: set[str] = set()
        for r in out:  # each request waits on its own rid: two of one batch under one rid would never return
            if r.rid in seen:
                raise RequestError(f"rid: {r.rid!r} names more than one request of the batch (rids must be unique; "
                                   "n > 1 adds -0, -1, ... to a prompt's rid)", 400, "rid")
            if r.rid in self.rid_to_state:
                raise RequestError(f"rid: {r.rid!r} is already in use by a running request", 400, "rid")
            seen.add(r.rid)
        return out

    async def run_on_tokenizer_thread(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the tokenizer thread (anything that tokenizes a long text)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, functools.partial(fn, *args))

    async def pretokenize(self, obj: io.GenerateReqInput) -> list[list[int]] | None:
        """The text prompts of `obj` tokenized off the event loop (None when it has none or they are malformed;
        `normalize` then reports the problem)."""
        texts = obj.text if isinstance(obj.text, list) else [obj.text]
        if obj.text is None or self.tokenizer is None or not all(isinstance(t, str) and t for t in texts):
            return None
        return [await self.tokenize_async(t) for t in texts]

    def _check_capacity(self, n: int) -> None:
        """A request of more samples than may ever wait at once is refused here; the scheduler, which knows how many
        are waiting (not running), refuses the rest when its queue is full."""
        limit = self.server_args.max_queued_requests
        if limit is not None and n > limit:
            raise RequestError(f"the server is overloaded: {n} requests at once, more than may wait "
                               f"(--max-queued-requests {limit}); retry later", 503)

    async def _prefill_shared_prompt(self, req: io.TokenizedGenerateReqInput) -> None:
        """For n > 1: prefill the prompt once (max_new_tokens=0) so the n samples share it through the radix
        cache."""
        sp = copy.copy(req.sampling_params)
        sp.max_new_tokens, sp.n = 0, 1
        warm = dataclasses.replace(req, rid=f"{req.rid}-prefill", stream=False, return_logprob=False,
                                   logprob_start_len=-1, top_logprobs_num=0, sampling_params=sp, log_metrics=False)
        async for _ in self._run_one(warm):
            pass

    def _register(self, rid: str, log_metrics: bool = True, stream: bool = True) -> ReqState:
        """A new request's state under `rid`. normalize() checks rids, but an n > 1 request or a batch registers its
        rids only after awaiting (the shared prefill, its tasks' start): a concurrent request under the same rid would
        take over the first one's state, which then never returned."""
        if rid in self.rid_to_state:
            raise RequestError(f"rid: {rid!r} is already in use by a running request", 400, "rid")
        state = ReqState(log_metrics=log_metrics, stream=stream)
        self.rid_to_state[rid] = state
        return state

    async def _run_one(self, req: io.TokenizedGenerateReqInput) -> AsyncIterator[dict[str, Any]]:
        self._ensure_loop()
        state = self._register(req.rid, req.log_metrics, req.stream)
        if self.server_args.log_requests:
            logger.info("request %s: %d prompt tokens, max_new_tokens=%d", log_safe(req.rid), len(req.input_ids),
                        req.sampling_params.max_new_tokens)
        try:
            message = self.unsent_aborts.pop(req.rid, None)
            if message is None:
                self.send_to_scheduler.send_pyobj(req)
            else:  # its request was aborted during the shared prefill: it ends here, never sent
                state.finished, state.meta["finish_reason"] = True, {"type": "abort", "message": message}
                state.event.set()
            while True:
                await self._wait_for_output(state)
                state.event.clear()
                out = self._make_output(req, state)
                if state.finished:
                    reason = state.meta.get("finish_reason") or {}
                    if self.server_args.log_requests:
                        logger.info("request %s finished: %d tokens, %s", log_safe(req.rid), len(state.output_ids),
                                    reason)
                    if reason.get("type") == "abort" and reason.get("status_code"):
                        raise RequestError(reason.get("message", "aborted"), reason["status_code"])
                    if self.metrics is not None and state.log_metrics:
                        self.metrics.observe_finished(state, req)
                    yield out
                    return
                if req.stream:
                    yield out
        finally:
            if not state.finished:
                self.abort_request(req.rid, "the client went away")
            self.rid_to_state.pop(req.rid, None)

    async def _wait_for_output(self, state: ReqState) -> None:
        """Wait for news of a request; fail it (503) rather than hang if the engine's processes have died."""
        while not state.event.is_set():  # (under load the news is often there already)
            try:
                async with asyncio.timeout(1.0):  # no task per wait, unlike wait_for before Python 3.12
                    await state.event.wait()
                return
            except TimeoutError:
                self._check_engine_alive()

    def _check_engine_alive(self) -> None:
        if self.processes is not None and not self.processes.alive():
            raise RequestError("the engine is not running: a scheduler or detokenizer process died", 503,
                               code="engine_dead")

    def _make_output(self, req: io.TokenizedGenerateReqInput, state: ReqState) -> dict[str, Any]:
        meta = {"id": req.rid, "prompt_tokens": state.meta.get("prompt_tokens", len(req.input_ids)),
                "completion_tokens": state.meta.get("completion_tokens", len(state.output_ids)),
                "cached_tokens": state.meta.get("cached_tokens", 0),
                "finish_reason": state.meta.get("finish_reason")}
        for key in ("spec_verify_ct", "spec_accept_length"):  # speculative decoding (when it ran)
            if key in state.meta:
                meta[key] = state.meta[key]
        if req.return_logprob:
            for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs",
                        "input_top_logprobs"):
                if key in state.meta:
                    meta[key] = state.meta[key]
        if "embedding" in state.meta:  # an embedding request (pooling)
            meta["embedding"] = state.meta["embedding"]
        return {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}

    async def generate_request(self, obj: io.GenerateReqInput) -> AsyncIterator[dict[str, Any]]:
        """Yields one dict per finished request (in order) or, when streaming, cumulative chunks tagged with
        `index` (the request's position in the batch)."""
        reqs = self.normalize(obj, await self.pretokenize(obj))
        self._check_capacity(len(reqs))
        if len(reqs) == 1 and not obj.is_batch():
            async for out in self._run_one(reqs[0]):
                yield out
            return
        # n > 1 or a batch: prefill each distinct prompt once, then run all concurrently
        children = self._adopt_samples(reqs)
        try:
            async for out in self._run_many(reqs):
                yield out
        finally:
            for rid in children:
                self.rid_parent.pop(rid, None)
                self.unsent_aborts.pop(rid, None)

    def _adopt_samples(self, reqs: list[io.TokenizedGenerateReqInput]) -> list[str]:
        """Records which request each n > 1 sample (and its shared prefill) belongs to, for `rids_of`."""
        children = []
        for r in reqs:
            if r.sampling_params.n > 1:
                parent = r.rid.rsplit("-", 1)[0]  # normalize named the samples f"{rid}-{j}"
                for rid in (r.rid, f"{r.rid}-prefill"):
                    if rid not in self.rid_parent:  # (a concurrent request under the same rid gets a 400 later)
                        self.rid_parent[rid] = parent
                        children.append(rid)
        return children

    def rids_of(self, rid: str) -> list[str]:
        """The running requests a client's rid names: that request itself, else the samples of its n > 1
        request, or the prompts of its OpenAI batch (`rid-p0`, ...: serving_base.make_rid) and their samples.
        Another client's request under `rid-2` is none of them."""
        if rid in self.rid_to_state:
            return [rid]
        return [r for r in self.rid_to_state if self._names(rid, r)]

    def _names(self, rid: str, other: str) -> bool:  # (see rids_of)
        prompt = re.compile(re.escape(rid) + r"-p\d+")
        parent = self.rid_parent.get(other, "")
        return parent == rid or bool(prompt.fullmatch(other)) or bool(prompt.fullmatch(parent))

    async def _run_many(self, reqs: list[io.TokenizedGenerateReqInput]) -> AsyncIterator[dict[str, Any]]:
        seen: set[tuple[int, ...]] = set()
        warmups = []
        for r in reqs:
            key = tuple(r.input_ids)
            if r.sampling_params.n > 1 and key not in seen:
                seen.add(key)
                warmups.append(self._prefill_shared_prompt(r))
        if warmups:
            await asyncio.gather(*warmups)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, r: io.TokenizedGenerateReqInput) -> None:
            try:
                async for out in self._run_one(r):
                    out["index"] = i
                    await queue.put(out)
            except Exception as e:  # surfaced to the caller in order
                await queue.put(e)
            finally:
                await queue.put(("done", i))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            done = 0
            while done < len(reqs):
                item = await queue.get()
                if isinstance(item, tuple):
                    done += 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    def abort_request(self, rid: str, message: str = "aborted") -> None:
        self.send_to_scheduler.send_pyobj(io.AbortReq(rid=rid, message=message))

    def abort_named(self, rid: str | None, message: str = "aborted") -> int:
        """Abort what a client's `rid` names (`rids_of`; None: every request), samples not sent yet (their prompt
        being prefilled once for them) included; returns how many run (at least 1 for a rid: it is sent anyway)."""
        rids = list(self.rid_to_state) if rid is None else self.rids_of(rid) or [rid]
        for r in rids:
            self.abort_request(r, message)
        self.unsent_aborts.update((s, message) for s in self.rid_parent
                                  if s not in self.rid_to_state and (rid is None or self._names(rid, s)))
        return len(rids)

    async def _control(self, req: Any, reply_type: type, timeout: float = 30.0) -> Any:
        """Send a control request and wait for its reply (`reply_type`, matched by the request's seq)."""
        self._ensure_loop()
        fut = asyncio.get_running_loop().create_future()
        req.seq = next(self._control_seq)
        self.pending_control[req.seq] = fut
        self.send_to_scheduler.send_pyobj(req)
        deadline = time.monotonic() + timeout
        try:
            while not fut.done():  # a dead process never answers: a 503 at once, not after `timeout` (up to 600 s)
                try:
                    async with asyncio.timeout(min(1.0, max(0.0, deadline - time.monotonic()))):
                        await asyncio.shield(fut)
                except TimeoutError:
                    self._check_engine_alive()
                    if time.monotonic() >= deadline:
                        raise
            out = fut.result()
        finally:
            self.pending_control.pop(req.seq, None)
        if not isinstance(out, reply_type):
            raise RuntimeError(f"control request {type(req).__name__} got a {type(out).__name__} reply")
        return out

    def _late_control_reply(self, obj: Any) -> None:
        """A LoRA load or unload that finished after its caller timed out: the adapter is (or is no longer) served
        all the same."""
        if isinstance(obj, io.LoadLoRAAdapterReqOutput) and obj.success and self.lora_names is not None:
            self.lora_names.add(obj.name)
        elif isinstance(obj, io.UnloadLoRAAdapterReqOutput) and obj.success and self.lora_names is not None:
            self.lora_names.discard(obj.name)

    async def flush_cache(self) -> bool:
        out = await self._control(io.FlushCacheReq(), io.FlushCacheReqOutput)
        return out.success

    # ---------------------------------------------------------------- LoRA adapters
    def check_lora(self, name: Any, param: str = "lora_path") -> str | None:
        """The adapter a request asks for (None: the base model); RequestError 404 when it is not served."""
        if name is None:
            return None
        if not isinstance(name, str) or not name:
            raise RequestError(f"{param} must be an adapter name (a string) or null", 400, param)
        if self.lora_names is None:
            raise RequestError(f"LoRA adapter {name!r} requested, but this server serves no adapters (start it "
                               "with --lora-paths or --enable-lora)", 400, param)
        if name not in self.lora_names:
            served = ", ".join(sorted(self.lora_names)) or "none"
            raise RequestError(f"LoRA adapter {name!r} is not loaded (served: {served}); load it with "
                               "/load_lora_adapter", 404, param)
        return name

    def _check_lora_control(self) -> None:
        if self.lora_names is None:
            raise RequestError("this server serves no LoRA adapters (start it with --enable-lora or --lora-paths)",
                               400)
        if self.server_args.dp_size > 1:
            raise RequestError("loading and unloading LoRA adapters at run time is not supported with --dp-size > "
                               "1 (give them with --lora-paths)", 400)

    async def load_lora_adapter(self, name: str, path: str) -> str:
        """Serve the PEFT adapter at `path` as `name`; RequestError when it cannot be."""
        self._check_lora_control()
        if not name or not isinstance(name, str) or not path or not isinstance(path, str):
            raise RequestError("lora_name and lora_path must be non-empty strings", 400)
        if name in self.lora_names:
            raise RequestError(f"LoRA adapter {name!r} is already loaded", 400, "lora_name")
        out = await self._control(io.LoadLoRAAdapterReq(name=name, path=path), io.LoadLoRAAdapterReqOutput, 300.0)
        if not out.success:
            raise RequestError(out.message, 400, "lora_path")
        self.lora_names.add(name)
        return out.message

    async def unload_lora_adapter(self, name: str, timeout: float = 600.0) -> str:
        """Stop serving `name`: new requests for it fail at once; it is unloaded when its running requests end."""
        self._check_lora_control()
        if name not in self.lora_names:
            raise RequestError(f"LoRA adapter {name!r} is not loaded", 404, "lora_name")
        self.lora_names.discard(name)  # new requests for it are refused from now on
        out = await self._control(io.UnloadLoRAAdapterReq(name=name), io.UnloadLoRAAdapterReqOutput, timeout)
        if not out.success:
            raise RequestError(out.message, 400, "lora_name")
        return out.message

    async def get_internal_state(self, timeout: float = 30.0) -> dict[str, Any]:
        out = await self._control(io.GetInternalStateReq(), io.GetInternalStateReqOutput, timeout)
        return out.state
