"""The HTTP routes, one router per concern: health, info, cache/abort control, metrics, the native /generate and
the OpenAI-compatible /v1 API, LoRA adapters at run time. `ROUTERS` is what the app mounts."""

from __future__ import annotations

from radixserve.entrypoints.routes import control, generate, health, info, lora, metrics, openai

ROUTERS = (health.router, info.router, control.router, metrics.router, generate.router, openai.router,
           lora.router)

__all__ = ["ROUTERS"]
