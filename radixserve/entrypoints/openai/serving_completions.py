"""POST /v1/completions: text (or token-id) prompts, single or batched, `n`, `echo`, `logprobs`, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from radixserve.entrypoints.http_utils import json_response, parse_model, sse_event
from radixserve.entrypoints.openai.errors import APIError
from radixserve.entrypoints.openai.protocol import CompletionRequest
from radixserve.entrypoints.openai.serving_base import OpenAIServingBase, finish_reason_str, matched_stop
from radixserve.managers import io_struct as io
from radixserve.managers.token_bytes import TextOffsets

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class OpenAIServingCompletion(OpenAIServingBase):
    object_prefix = "cmpl"

    async def _prompts(self, req: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
        p = req.prompt
        if isinstance(p, str):
            texts: list[Any] = [p]
        elif not p:
            raise APIError("prompt: must not be empty", 400, "prompt", "invalid_value")
        elif isinstance(p[0], int):
            texts = [p]
        else:
            texts = list(p)
        ids_list: list[list[int]] = []
        prompt_texts: list[str | None] = []
        for i, item in enumerate(texts):
            where = "prompt" if len(texts) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                if not item:
                    raise APIError(f"{where}: must not be empty", 400, "prompt", "invalid_value")
                ids_list.append(await self.tokenize(item, "prompt"))
                prompt_texts.append(item)
            else:
                if not item:
                    raise APIError(f"{where}: must not be empty", 400, "prompt", "invalid_value")
                ids_list.append(list(item))
                prompt_texts.append(None)
        return ids_list, prompt_texts

    def _echo_text(self, ids: list[int], text: str | None) -> str:
        if text is not None:
            return text
        tok = self.tm.tokenizer
        return tok.decode(ids) if tok is not None else ""

    async def create(self, request: Request, body: dict[str, Any]) -> Response:
        req = parse_model(CompletionRequest, body)
        lora = self.check_common(req)
        ids_list, prompt_texts = await self._prompts(req)
        if req.max_tokens is not None and "max_tokens" in req.model_fields_set:
            max_new = req.max_tokens  # requested: a 400 below if it does not fit
        else:  # the default is clamped to what fits (one rule with /generate and chat)
            max_new = max(0, min(DEFAULT_MAX_TOKENS, self.tm.context_len - max(len(i) for i in ids_list)))
        for ids in ids_list:
            self.check_length(len(ids), max_new, "prompt")
        want_lp = req.logprobs is not None
        rid, rids = self.make_rid(req, len(ids_list))
        obj = io.GenerateReqInput(
            input_ids=ids_list[0] if len(ids_list) == 1 else ids_list,
            sampling_params=self.sampling_params(req, max_new), rid=rids,
            stream=req.stream, return_logprob=want_lp,
            logprob_start_len=0 if (want_lp and req.echo) else -1, top_logprobs_num=req.logprobs or 0,
            lora_path=lora)
        n = req.n
        if req.stream:
            return await self.stream(request, obj, "prompt",
                                     lambda outs: self._render_stream(req, outs, ids_list, prompt_texts, rid, n))
        outs = await self.collect(request, obj, "prompt")
        choices = []
        completion_tokens = cached = 0
        for k, out in enumerate(outs):
            meta = out["meta_info"]
            p = k // n
            text = out["text"]
            logprobs = None
            if req.echo:
                text = self._echo_text(ids_list[p], prompt_texts[p]) + text
            if want_lp:
                token_lps = list(meta.get("output_token_logprobs") or [])
                top_lps = list(meta.get("output_top_logprobs") or [])
                if req.echo:
                    token_lps = list(meta.get("input_token_logprobs") or []) + token_lps
                    top_lps = list(meta.get("input_top_logprobs") or [None] * len(ids_list[p])) + top_lps
                offsets = self.text_offsets(req.skip_special_tokens, ids_list[p] if req.echo else None,
                                            self._echo_text(ids_list[p], prompt_texts[p]) if req.echo else None)
                logprobs = self.completion_logprobs(token_lps, top_lps, bool(req.logprobs), offsets)
            reason = meta.get("finish_reason")
            choices.append({"index": k, "text": text, "logprobs": logprobs, "finish_reason": finish_reason_str(reason),
                            "matched_stop": matched_stop(reason)})
            completion_tokens += meta.get("completion_tokens", 0)
            if k % n == 0:
                cached += meta.get("cached_tokens", 0)
        resp = self.base_response(rid, "text_completion", req)
        resp["choices"] = choices
        resp["usage"] = self.usage(sum(len(i) for i in ids_list), completion_tokens, cached)
        return json_response(resp)

    async def _render_stream(self, req: CompletionRequest, outs: AsyncIterator[dict[str, Any]],
                             ids_list: list[list[int]], prompt_texts: list[str | None], rid: str,
                             n: int) -> AsyncIterator[bytes]:
        base = self.base_response(rid, "text_completion", req)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        want_lp = req.logprobs is not None
        sent_text: dict[int, int] = {}
        sent_lp: dict[int, int] = {}
        offsets: dict[int, TextOffsets] = {}  # per choice
        completion: dict[int, int] = {}
        cached: dict[int, int] = {}
        prompt_tokens = sum(len(i) for i in ids_list)
        async for out in outs:
            k = out.get("index", 0)
            p = k // n
            meta = out["meta_info"]
            first = k not in sent_text
            text = out["text"]
            delta = text[sent_text.get(k, 0):]
            sent_text[k] = len(text)
            completion[k] = meta.get("completion_tokens", 0)
            cached[k] = meta.get("cached_tokens", 0)
            logprobs = None
            if want_lp:
                token_lps = list(meta.get("output_token_logprobs") or [])
                top_lps = list(meta.get("output_top_logprobs") or [])
                start = sent_lp.get(k, 0)
                new_lps, new_tops = token_lps[start:], top_lps[start:]
                sent_lp[k] = len(token_lps)
                if first and req.echo:
                    new_lps = list(meta.get("input_token_logprobs") or []) + new_lps
                    new_tops = list(meta.get("input_top_logprobs") or [None] * len(ids_list[p])) + new_tops
                if k not in offsets:
                    offsets[k] = self.text_offsets(req.skip_special_tokens, ids_list[p] if req.echo else None,
                                                   self._echo_text(ids_list[p], prompt_texts[p]) if req.echo
                                                   else None)
                logprobs = self.completion_logprobs(new_lps, new_tops, bool(req.logprobs), offsets[k])
            if first and req.echo:
                delta = self._echo_text(ids_list[p], prompt_texts[p]) + delta
            reason = meta.get("finish_reason")
            if not delta and reason is None and not (logprobs and logprobs["tokens"]):
                continue
            chunk = dict(base)
            chunk["choices"] = [{"index": k, "text": delta, "logprobs": logprobs,
                                 "finish_reason": finish_reason_str(reason), "matched_stop": matched_stop(reason)}]
            if include_usage:
                chunk["usage"] = None
            if continuous:
                chunk["usage"] = self.usage(prompt_tokens, sum(completion.values()),
                                            sum(v for j, v in cached.items() if j % n == 0))
            yield sse_event(chunk)
        if include_usage:
            chunk = dict(base)
            chunk["choices"] = []
            chunk["usage"] = self.usage(prompt_tokens, sum(completion.values()),
                                        sum(v for j, v in cached.items() if j % n == 0))
            yield sse_event(chunk)
