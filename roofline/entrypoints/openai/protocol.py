"""Request and response models of the OpenAI-compatible API (pydantic v2).

Field names and shapes follow OpenAI's API reference. Extra sampling fields that OpenAI lacks but
serving engines accept (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`,
`priority`, ...) are accepted at the top level of the body (the openai client sends them via
`extra_body`). Unknown fields are ignored so that clients sending newer fields keep working.

Types are strict: `max_tokens: true`, `stream: "yes"` or `n: 2.0` are 400s, not coerced (an integer is
still accepted where a float is expected); every integer of a request is a signed 64-bit value (Int64, a
400 naming the field beyond: nothing past 64 bits reaches the engine's msgpack messages), token ids are
non-negative; roles are the ones OpenAI defines.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]  # every integer field of a request
TokenId = Annotated[int, Field(ge=0, le=SEED_MAX)]  # the engine checks it against the vocabulary
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# --------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --------------------------------------------------------------------------- shared pieces
class StreamOptions(OpenAIModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class JsonSchemaFormat(OpenAIModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIModel):
    type: str  # "text" | "json_object" | "json_schema"
    json_schema: Optional[JsonSchemaFormat] = None


class _SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: Optional[str] = None
    n: Int64 = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[Int64] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # Extensions (sent by clients through extra_body)
    top_k: Optional[Int64] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    priority: Int64 = 0
    stop_token_ids: Optional[list[TokenId]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Beam search (vLLM's fields): n is the beam width; the n best beams come back as the choices
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Structured outputs (entrypoints/openai/structured_outputs.py): OpenAI's response_format, vLLM's
    # structured_outputs dict and its older guided_* fields
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    # Prefill/decode disaggregation (vLLM's field): do_remote_decode, do_remote_prefill, remote_* ...
    kv_transfer_params: Optional[dict[str, Any]] = None


# --------------------------------------------------------------------------- completions
class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[TokenId], list[str], list[list[TokenId]]]
    max_tokens: Optional[Int64] = 16
    echo: bool = False
    logprobs: Optional[Int64] = None
    suffix: Optional[str] = None
    best_of: Optional[Int64] = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    kv_transfer_params: Optional[dict[str, Any]] = None  # a prefill for another engine: what its decoder needs


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# --------------------------------------------------------------------------- chat completions
class ChatContentPart(OpenAIModel):
    type: str
    text: Optional[str] = None


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal[CHAT_ROLES]
    content: Optional[Union[str, list[ChatContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[Int64] = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Optional[Int64] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Int64] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    functions: Optional[list[dict[str, Any]]] = None  # OpenAI's deprecated form of tools
    function_call: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    # Extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # the answer starts with the last message's content when that is the assistant's
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    # the reasoning model's thinking (--reasoning-parser): reasoning_content (vLLM's name) and reasoning (newer)
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    kv_transfer_params: Optional[dict[str, Any]] = None  # a prefill for another engine: what its decoder needs


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# --------------------------------------------------------------------------- models
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "roofline"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model
    max_model_len: Optional[int] = None
    vocab_size: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --------------------------------------------------------------------------- tokenizer endpoints
# --------------------------------------------------------------------------- LoRA adapters at runtime
class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str
    lora_int_id: Optional[Int64] = None  # vLLM's field; the name decides


class TokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
