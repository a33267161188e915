"""Request models of the HTTP API (OpenAI-compatible and native), as strict pydantic models.

Every model forbids unknown fields (a 400 that names them: nothing is silently ignored) and validates types
strictly ("1" is not an integer; 1 is a valid float). Ranges that OpenAI documents are checked here so the error
names the OpenAI field; the engine's `SamplingParams.verify` checks the rest. Responses are built as plain dicts
(see the serving modules) and serialised with orjson.

Three kinds of fields beyond the ones we serve:
- fields that change nothing, accepted as OpenAI accepts them: `user` and `safety_identifier` (an end-user id for
  the caller's own abuse tracking; OpenAI's output does not depend on it, nor does ours), `prompt_cache_key` (a hint
  for routing to a warm cache: the radix cache shares every common prefix whatever the key), `metadata` (tags of a
  stored completion; we store none), `store: false`, `service_tier: "auto"/"default"`, `modalities: ["text"]`,
  `verbosity: "medium"` (the default), `prompt_cache_retention: "in_memory"` (the only retention we have); and on
  messages the fields the `openai` SDK's own response message carries (`refusal`, `annotations`, `audio`,
  `function_call` as null);
- null means the default for every optional field, `n`, `stream` and `echo` included (as OpenAI reads them);
- fields of features not implemented (the deprecated `functions`/`function_call`, reasoning effort): accepted when
  null or default, any other value is a 400 -- all such checks live in `feature_gates.py`, which the features replace;
- `response_format.json_schema`: `schema` constrains the output; `strict` is honoured whatever its value (the
  output always follows the schema, which `strict: false` also allows); `name` is checked as OpenAI checks it
  (1-64 of a-z, A-Z, 0-9, _ and -) and otherwise changes nothing, as with OpenAI; `description` is rejected (a
  400): OpenAI shows it to the model, and we cannot without changing the prompt."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # usage in every chunk (vLLM extension)


class JsonSchemaFormat(_Strict):
    name: str | None = Field(default=None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None  # non-null is a 400 (see the module docstring)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1, le=128)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    user: str | None = None  # changes nothing (see the module docstring)
    # SGLang / vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None  # the schema as text (SGLang) or as an object
    ebnf: str | None = None
    rid: str | None = None  # request id, usable with /abort_request
    response_format: ResponseFormat | None = None  # OpenAI: chat; also accepted on completions
    lora_path: str | None = None  # SGLang extension: a LoRA adapter's name (or say it in `model`)

    @field_validator("n", "stream", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if v is None else v


class _NoOpFields(_Strict):
    """Request fields that change nothing when null or default; other values are checked in feature_gates."""

    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # enforced by the grammar of a forced call; with tool_choice "auto" only false/null


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # a JSON object as text, as OpenAI returns it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction
    index: int | None = None  # present when a client rebuilt the call from stream deltas


class _ToolFields(_Strict):
    """Tool calling and reasoning request fields (see chat_tools; the deprecated `functions` / `function_call` and
    `reasoning_effort` only null in feature_gates)."""

    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template (e.g. enable_thinking)
    separate_reasoning: bool = True  # with --reasoning-parser: thinking in reasoning_content (false: inline)

    @field_validator("separate_reasoning", mode="before")
    @classmethod
    def _null_is_true(cls, v: Any) -> Any:
        return True if v is None else v
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: str | None = None  # only null (feature_gates)

    @field_validator("echo", mode="before")
    @classmethod
    def _null_is_false(cls, v: Any) -> Any:
        return False if v is None else v

    @model_validator(mode="after")
    def _best_of_covers_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        return self


class ContentPart(_Strict):
    type: str
    text: str | None = None
    # other part kinds are recognised so the error can say they are unsupported
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # what the openai SDK's response message carries when a client appends it to the history (null: no effect;
    # other values are checked in feature_gates)
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    reasoning_content: str | None = None  # assistant: its thinking, passed to templates that use it


class ChatCompletionRequest(_SamplingFields, _NoOpFields, _ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class GenerateRequest(_Strict):
    """POST /generate (native API)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    lora_path: str | list[str | None] | None = None  # LoRA adapter name(s), one per prompt for a batch
    # SGLang's request fields for features we do not have: accepted when null/false (feature_gates)
    custom_logit_processor: str | list[str | None] | None = None
    return_hidden_states: bool = False

    @field_validator("stream", "return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
                     "return_hidden_states", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if v is None else v


class LoadLoRAAdapterRequest(_Strict):
    """POST /load_lora_adapter."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Strict):
    """POST /unload_lora_adapter."""

    lora_name: str


class AbortRequest(_Strict):
    """POST /abort_request."""

    rid: str | None = None
    abort_all: bool = False


# ---------------------------------------------------------------------------------------------- /v1/responses
class ResponsesFunctionTool(_Strict):
    """A function tool in the Responses form (flat: no `function` wrapper)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedFunction(_Strict):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None  # as response_format's: a 400 when set


class ResponsesText(_Strict):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None  # "medium" or null only (feature_gates, as on chat)


class ResponsesReasoning(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # the reasoning text itself; "concise": a 400
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # (deprecated name of summary)


class ResponsesRequest(_Strict):
    """POST /v1/responses. `input` items are checked one by one in responses_items (so errors name `input[i]`);
    fields of features we do not have are accepted when null/default (checked in responses_items)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # function tools (ResponsesFunctionTool), checked in responses_items
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # {"include_obfuscation": ...}: nothing to obfuscate
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    store: bool | None = None  # null: true (stored unless --responses-store-size 0; see response_store)
    previous_response_id: str | None = None  # a stored response to continue
    conversation: str | dict[str, Any] | None = None  # not implemented
    prompt: dict[str, Any] | None = None  # prompt templates: not implemented
    include: list[str] | None = None  # only [] / null
    truncation: Literal["auto", "disabled"] | None = None  # "auto" is a 400 (nothing is truncated)
    background: bool | None = None  # only false / null
    max_tool_calls: int | None = None  # only null
    top_logprobs: int | None = None  # only null / 0
    rid: str | None = None  # SGLang extension: the engine request id, usable with /abort_request

    @field_validator("stream", mode="before")
    @classmethod
    def _null_is_false(cls, v: Any) -> Any:
        return False if v is None else v


class ResponsesTextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None  # from a previous response's output: only []
    logprobs: list[dict[str, Any]] | None = None


class ResponsesMessageItem(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]  # parts checked one by one (ResponsesTextPart)
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: str | None = None


class ResponsesFunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponsesFunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ResponsesTextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponsesReasoningItem(_Strict):
    """Past reasoning: accepted and left out of the prompt (chat templates drop past thinking)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
