"""What every route shares: the running engine, the server's flags and its lifecycle state (stored on
`app.state.server`; routes reach it with `server_state(request)`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import Request

from radixserve.entrypoints.openai.errors import APIError
from radixserve.entrypoints.openai.serving_chat import OpenAIServingChat
from radixserve.entrypoints.openai.serving_completions import OpenAIServingCompletion
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.server_args import ServerArgs

HEALTH_TIMEOUT_S = 60.0  # the longest /health waits for the scheduler


@dataclasses.dataclass
class ServerState:
    tm: TokenizerManager
    processes: Any  # EngineProcesses (alive(), dead(), shutdown())
    server_args: ServerArgs
    served_model_name: str
    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    metrics: Any = None
    grammar_ok: bool = False
    live_stats: Any = None  # the dashboard's recent figures (web.live_stats.LiveStats)
    embeddings: Any = None  # OpenAIServingEmbedding on a --is-embedding server
    responses: Any = None  # OpenAIServingResponses (/v1/responses, over `chat`)
    start_time: float = dataclasses.field(default_factory=time.time)
    draining: bool = False  # SIGTERM received: new requests get 503 while in-flight ones finish
    dead_child: str | None = None  # "the scheduler process (pid N) was killed by SIGKILL", once one died

    def abort_all(self, message: str) -> int:
        return self.tm.abort_named(None, message)

    def engine_dead_message(self) -> str | None:
        if self.dead_child is not None:
            return f"the engine is not running: {self.dead_child}; see the server log"
        if not self.processes.alive():
            return "the engine is not running (a scheduler or detokenizer process died); see the server log"
        return None

    def ensure_alive(self) -> None:
        msg = self.engine_dead_message()
        if msg is not None:
            raise APIError(msg, 503, None, "engine_dead")

    def ensure_generation(self) -> None:
        """Generation routes on a --is-embedding server are a 400 (and /v1/embeddings, /encode on others)."""
        if self.server_args.is_embedding:
            raise APIError("this server serves embeddings (--is-embedding): use /v1/embeddings or /encode", 400,
                           None, "wrong_server_kind")

    def ensure_embedding(self) -> None:
        if not self.server_args.is_embedding or self.embeddings is None:
            raise APIError("this server generates text: embeddings need a server started with --is-embedding", 400,
                           None, "wrong_server_kind")

    def ensure_serving(self) -> None:
        """New generation work is refused (503) while draining or once the engine died."""
        if self.draining:
            raise APIError("the server is shutting down", 503, None, "shutting_down")
        self.ensure_alive()

    @property
    def control_timeout(self) -> float:
        return min(self.server_args.watchdog_timeout, HEALTH_TIMEOUT_S)


def server_state(request: Request) -> ServerState:
    return request.app.state.server
