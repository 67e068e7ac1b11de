"""Request models of the OpenAI-compatible API.

Unknown fields are ignored (clients send `user`, `service_tier`, `parallel_tool_calls`... freely); known
fields are typed and range-checked here so that bad values become 400s before anything reaches the engine.
Responses are plain dicts built in chat_api / completions_api: the streaming hot path should not pay for
model validation on every chunk.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, field_validator, model_validator

MAX_N = 16
MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Token ids are 32-bit in every tokenizer backend; larger numbers overflow there instead of being "unknown".
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
# Function names: OpenAI's rule (letters, digits, _ and -), plus the "." and ":" of namespaced tools.
TOOL_NAME = r"^[a-zA-Z0-9_.:-]{1,128}$"
# OpenAI's reasoning_effort values, plus the template's own "max".
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "max"]


class _Model(BaseModel):
    # NaN/inf are valid Python floats but never valid sampling values.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class FunctionDef(_Model):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceFunction(_Model):
    name: Annotated[str, Field(pattern=TOOL_NAME)]


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ImageURL(_Model):
    url: str
    detail: str | None = None  # OpenAI's resolution hint; the tower's canvas is the checkpoint's whatever it says


class ContentPart(_Model):
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None  # type "image_url" (a string: what some clients send)
    # Where the part stood in the request as sent, when another wire format was translated into chat (errors name
    # the client's own field); never read from a request body.
    _origin: str | None = PrivateAttr(default=None)


class ToolCallFunction(_Model):
    name: Annotated[str, Field(min_length=1)]
    # OpenAI sends a JSON string; some clients send the object itself.
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


# What _tool_message_names_its_call checks, said in the schema too (clients and fuzzers generate from it).
TOOL_NEEDS_CALL_ID = {"if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
                      "then": {"required": ["tool_call_id"],
                               "properties": {"tool_call_id": {"type": "string", "minLength": 1}}}}


class ChatMessage(_Model):
    model_config = ConfigDict(**_Model.model_config, json_schema_extra=TOOL_NEEDS_CALL_ID)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # Prior thinking on an assistant turn: OpenAI-compatible servers use either name.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _tool_message_names_its_call(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        return self


class StreamOptions(_Model):
    include_usage: bool = False


class JsonSchemaSpec(_Model):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class SamplingFields(_Model):
    model: str | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's (benchmark clients send them): no end-of-turn token before min_tokens, or before max_tokens at all.
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    ignore_eos: StrictBool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops


class ChatFields(_Model):
    """What decides a chat prompt: shared by /v1/chat/completions and /tokenize (which mirrors it)."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Thinking control: none/minimal = off, low, medium/high = the template's high, max (see docs/chat.md).
    reasoning_effort: ReasoningEffort | None = None
    # Lowers the server's GLM53_REASONING_BUDGET for this request; 0 turns thinking off.
    max_reasoning_tokens: Annotated[StrictInt, Field(ge=0)] | None = None


class ChatCompletionRequest(SamplingFields, ChatFields):
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    response_format: ResponseFormat | None = None


class TokenizeRequest(ChatFields):
    """A raw `prompt`, or the fields of a chat request (messages, tools, tool_choice, chat_template_kwargs,
    reasoning_effort...): then the prompt the chat route would run, every server change included."""

    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None  # type: ignore[assignment]
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[TokenId]
