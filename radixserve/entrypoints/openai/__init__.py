"""The OpenAI-compatible API: request/response models (`protocol`), errors, and the serving handlers for
/v1/completions and /v1/chat/completions."""
