"""POST /v1/responses (OpenAI's Responses API) on the chat path: the request becomes a chat request
(responses_items), which is prepared and run by OpenAIServingChat; its answer, read by the same ChoiceOutput
(reasoning and tool-call parsing), becomes output items.

Streaming sends the Responses events (`event:` and `data:` lines, `sequence_number` counting from 0, no [DONE]):
`response.created`, `response.in_progress`, then per output item `response.output_item.added`, its part's
`response.content_part.added`, the deltas (`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`), their `.done`, `response.content_part.done` and
`response.output_item.done`; last `response.completed` (or `response.incomplete` when max_output_tokens cut the
answer) with the whole response. With `reasoning.summary`, a reasoning item also streams its summary (the
reasoning text itself): `response.reasoning_summary_part.added` after its content part is added, a
`response.reasoning_summary_text.delta` after each `response.reasoning_text.delta`, and after the content part is
done `response.reasoning_summary_text.done` and `response.reasoning_summary_part.done`. An error after the stream
began is an `error` event; a client that leaves aborts the request.

Storage (response_store.py, --responses-store-size): a response whose request leaves `store` true or null is kept
once it is complete or incomplete (streamed ones too; failed and aborted ones never), with its input items and
output; `previous_response_id` continues one (its input and output items go before the request's `input`; its
`instructions` do not carry over), GET /v1/responses/{id} returns it, DELETE drops it, and GET
/v1/responses/{id}/input_items lists its input items (`order`, `limit`, `after`, `before` as OpenAI's)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from radixserve.entrypoints.http_utils import json_response, parse_model
from radixserve.entrypoints.openai.chat_output import ChoiceOutput, OutputConfig
from radixserve.entrypoints.openai.errors import APIError
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest
from radixserve.entrypoints.openai.response_store import ResponseStore, StoredResponse
from radixserve.entrypoints.openai.responses_items import (
    call_item,
    chat_request_body,
    check_request,
    input_items,
    message_item,
    new_item_id,
    output_items,
    reasoning_item,
    remap_error,
    response_object,
    summary_part,
    usage,
    wants_summary,
)
from radixserve.entrypoints.openai.serving_base import finish_reason_str
from radixserve.entrypoints.openai.serving_chat import OpenAIServingChat, PreparedChat


class OpenAIServingResponses:
    """/v1/responses over the server's chat service."""

    def __init__(self, chat: OpenAIServingChat, store_size: int = 0) -> None:
        self.chat = chat
        self.store = ResponseStore(store_size)

    async def create(self, request: Request, body: dict[str, Any]) -> Response:
        req = parse_model(ResponsesRequest, body)
        check_request(req)
        storing = self._storing(req)
        history = self._history(req)
        tok = self.chat.tm.tokenizer
        template = getattr(tok, "chat_template", None) if tok is not None else None
        template = template if isinstance(template, str) or template is None else json.dumps(template)
        try:
            chat_req = parse_model(ChatCompletionRequest, chat_request_body(req, template, history))
            prep = await self.chat.prepare(chat_req)
        except APIError as e:
            raise remap_error(e) from None
        model = self.chat.response_model(chat_req)
        created = int(time.time())
        inputs = history + input_items(req.input) if storing else []

        def keep(response: dict[str, Any]) -> None:
            if storing:
                self.store.put(response, inputs)

        if req.stream:
            events = ResponseEvents(req, prep, model, created, self._count_tokens, stored=storing, on_done=keep)
            return await self.chat.stream(request, prep.obj, "input", events.render, error_event=events.error,
                                          done=None)
        outs = await self.chat.collect(request, prep.obj, "input")
        out = outs[0]
        meta = out["meta_info"]
        message = ChoiceOutput(prep.cfg).message(out["text"])
        cut = finish_reason_str(meta.get("finish_reason")) == "length"
        items = output_items(message, cut, wants_summary(req))
        used = usage(prep.prompt_len, meta.get("completion_tokens", 0), meta.get("cached_tokens", 0),
                     await self._count_tokens(message.get("reasoning_content") or ""))
        response = response_object(req, f"resp_{prep.rid}", model, created, "incomplete" if cut else "completed",
                                   items, used, store=storing)
        keep(response)
        return json_response(response)

    # ------------------------------------------------------------------ storage
    def _storing(self, req: ResponsesRequest) -> bool:
        """Whether the response will be stored: `store` true or null (OpenAI's default) on a server that stores."""
        if not self.store.enabled:
            if req.store:
                raise APIError("store: this server stores no responses (started with --responses-store-size 0); "
                               "send store false or null, or restart it with --responses-store-size N", 400,
                               "store", "unsupported_parameter")
            return False
        return req.store is not False

    def _history(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        """The stored conversation `previous_response_id` continues (its input and output items), or []."""
        rid = req.previous_response_id
        if rid is None:
            return []
        if not self.store.enabled:
            raise APIError("previous_response_id: this server stores no responses (started with "
                           "--responses-store-size 0); send the whole conversation in input", 400,
                           "previous_response_id", "unsupported_parameter")
        found = self.store.get(rid)
        if found is None:
            raise APIError(f"previous_response_id: no stored response has id {rid!r} (never stored, deleted, or "
                           f"evicted: the server keeps the {self.store.capacity} most recently used)", 404,
                           "previous_response_id", "previous_response_not_found")
        return found.conversation()

    def _stored(self, response_id: str) -> StoredResponse:
        found = self.store.get(response_id)
        if found is None:
            raise APIError(f"no stored response has id {response_id!r}", 404, "response_id", "response_not_found")
        return found

    def retrieve(self, response_id: str, query: Mapping[str, str]) -> Response:
        """GET /v1/responses/{response_id}: the stored response object."""
        if query.get("stream", "false").lower() not in ("false", "0", ""):
            raise APIError("stream: a stored response can only be retrieved whole (stream false)", 400, "stream",
                           "unsupported_parameter")
        return json_response(self._stored(response_id).response)

    def delete(self, response_id: str) -> Response:
        """DELETE /v1/responses/{response_id}."""
        if not self.store.delete(response_id):
            raise APIError(f"no stored response has id {response_id!r}", 404, "response_id", "response_not_found")
        return json_response({"id": response_id, "object": "response", "deleted": True})

    def list_input_items(self, response_id: str, query: Mapping[str, str]) -> Response:
        """GET /v1/responses/{response_id}/input_items: the stored input items, paged as OpenAI pages them."""
        limit_text = query.get("limit", "20")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
            raise APIError(f"limit: must be an integer from 1 to 100, got {limit_text!r}", 400, "limit",
                           "invalid_value")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(f"order: must be 'asc' or 'desc', got {order!r}", 400, "order", "invalid_value")
        if query.get("include"):
            raise APIError("include: no extra output can be included", 400, "include", "unsupported_parameter")
        items = list(self._stored(response_id).input_items)
        if order == "desc":
            items.reverse()
        ids = [i["id"] for i in items]
        for name in ("after", "before"):
            cursor = query.get(name)
            if cursor is None:
                continue
            if cursor not in ids:
                raise APIError(f"{name}: response {response_id!r} has no input item {cursor!r}", 400, name,
                               "invalid_value")
            k = ids.index(cursor)
            items, ids = (items[k + 1:], ids[k + 1:]) if name == "after" else (items[:k], ids[:k])
        page = items[:int(limit_text)]
        return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})

    async def _count_tokens(self, text: str) -> int:
        """The tokens of the reasoning text (the engine counts the answer's tokens as a whole)."""
        if not text:
            return 0
        return len(await self.chat.tokenize(text, "input", add_special_tokens=False))


class ResponseEvents:
    """The events of one streamed response, built from the chat stream's deltas (ChoiceOutput.deltas)."""

    def __init__(self, req: ResponsesRequest, prep: PreparedChat, model: str, created: int, count_tokens: Any,
                 stored: bool = False, on_done: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.req = req
        self.stored = stored  # the response says "store": true
        self.on_done = on_done  # called with the final response before its last event
        self.summary = wants_summary(req)
        self.prep = prep
        self.cfg: OutputConfig = prep.cfg
        self.model = model
        self.created = created
        self.count_tokens = count_tokens
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the output items, as sent
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""  # its text (or arguments) so far
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index
        self.has_message = False

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def error(self, err: APIError) -> bytes:
        return self.event("error", code=err.code, message=err.message, param=err.param)

    def response(self, status: str, output: list[dict[str, Any]], used: dict[str, Any] | None) -> dict[str, Any]:
        return response_object(self.req, f"resp_{self.prep.rid}", self.model, self.created, status, output, used,
                               self.stored)

    # ------------------------------------------------------------------ items
    def _where(self) -> dict[str, Any]:
        if self.open is None:  # (an internal ordering error: every delta comes after its item was added)
            raise RuntimeError("a Responses stream event came before its output item was opened")
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        out = self.close("completed")
        self.items.append(item)
        self.open = item
        self.text = ""
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        part = {"reasoning": {"type": "reasoning_text", "text": ""},
                "message": {"type": "output_text", "text": "", "annotations": []}}.get(item["type"])
        if part is not None:
            out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        if item["type"] == "reasoning" and self.summary:
            out.append(self.event("response.reasoning_summary_part.added", **self._where(), summary_index=0,
                                  part=summary_part("")))
        return out

    def close(self, status: str) -> list[bytes]:
        """The events that end the open item (with `status`)."""
        item, text = self.open, self.text
        if item is None:
            return []
        where = self._where()
        out = []
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], text, status, self.summary)
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=done["content"][0]))
            if self.summary:
                out.append(self.event("response.reasoning_summary_text.done", **where, summary_index=0, text=text))
                out.append(self.event("response.reasoning_summary_part.done", **where, summary_index=0,
                                      part=done["summary"][0]))
        elif item["type"] == "message":
            done = message_item(item["id"], text, status)
            out.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=done["content"][0]))
        else:
            done = call_item(item["id"], item["call_id"], item["name"], text, status)
            out.append(self.event("response.function_call_arguments.done", **where, arguments=text))
        self.items[where["output_index"]] = done
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=done))
        self.open = None
        return out

    def on_delta(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            if self.open is None or self.open["type"] != "reasoning":
                out += self._add({"id": new_item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                                  "status": "in_progress"})
            self.text += delta["reasoning_content"]
            out.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0,
                                  delta=delta["reasoning_content"]))
            if self.summary:
                out.append(self.event("response.reasoning_summary_text.delta", **self._where(), summary_index=0,
                                      delta=delta["reasoning_content"]))
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                out += self._add({"id": new_item_id("msg"), "type": "message", "status": "in_progress",
                                  "role": "assistant", "content": []})
                self.has_message = True
            self.text += delta["content"]
            out.append(self.event("response.output_text.delta", **self._where(), content_index=0,
                                  delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a new call: its id and name
                out += self._add({"id": new_item_id("fc"), "type": "function_call", "status": "in_progress",
                                  "call_id": call["id"], "name": call["function"]["name"], "arguments": ""})
                self.calls[call["index"]] = len(self.items) - 1
            args = call.get("function", {}).get("arguments") or ""
            if args and self.open is not None and self.calls.get(call["index"]) == len(self.items) - 1:
                self.text += args
                out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=args))
        return out

    # ------------------------------------------------------------------ the stream
    async def render(self, outs: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
        started = self.response("in_progress", [], None)
        yield self.event("response.created", response=started)
        yield self.event("response.in_progress", response=started)
        reader = ChoiceOutput(self.cfg)
        meta: dict[str, Any] = {}
        async for out in outs:
            meta = out["meta_info"]
            for delta in reader.deltas(out["text"], meta.get("finish_reason") is not None):
                for chunk in self.on_delta(delta):
                    yield chunk
        cut = finish_reason_str(meta.get("finish_reason")) == "length"
        if not self.has_message and not self.calls:  # an answer without text or calls: an empty message
            for chunk in self._add({"id": new_item_id("msg"), "type": "message", "status": "in_progress",
                                    "role": "assistant", "content": []}):
                yield chunk
        for chunk in self.close("incomplete" if cut else "completed"):
            yield chunk
        reasoning = "".join(c["text"] for i in self.items if i["type"] == "reasoning" for c in i["content"])
        used = usage(self.prep.prompt_len, meta.get("completion_tokens", 0), meta.get("cached_tokens", 0),
                     await self.count_tokens(reasoning))
        status = "incomplete" if cut else "completed"
        final = self.response(status, self.items, used)
        if self.on_done is not None:  # (stored before the client hears it is done, so it can GET it at once)
            self.on_done(final)
        yield self.event(f"response.{status}", response=final)
