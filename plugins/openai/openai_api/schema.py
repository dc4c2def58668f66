"""The request bodies of /v1/chat/completions, /v1/completions, /v1/embeddings and /v1/rerank,
as the OpenAPI document describes them (``body=`` on each route).

The bodies are read by the chat service (the chat plugin's readers, for chat and
completions) and by rerank.py and the embeddings route here: these models document that
reading, its bounds and its refusals (the SDK's, ``localm.sdk.chat``); they validate nothing.
A field not listed here is reported in ``X-Localm-Ignored-Fields`` (or refused with
``X-Localm-Strict``, or with 400 ``field_not_honoured`` when it would change the output).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from localm import sdk
from localm.sdk.chat import EFFORTS, MAX_GRAMMAR_BYTES, MAX_MESSAGES, MAX_NUM_CTX, MAX_STOP_CHARS, MAX_STOPS, MAX_TOOLS

Meta = sdk.Meta

#: A reply cap: at least 1 (the model's window bounds the reply too: finish_reason "length").
MaxTokens = Annotated[int, Meta(ge=1, description="The reply cap, in tokens (at least 1; the reply also ends "
                                                  "where the model's window is full)")]
Stop = Union[Annotated[str, Meta(max_length=MAX_STOP_CHARS)],
             Annotated[list[Annotated[str, Meta(max_length=MAX_STOP_CHARS)]], Meta(max_length=MAX_STOPS)]]
ModelName = Annotated[str, Meta(description="A registered model, alias or capability route (left out: the active "
                                            "model)")]


class TextPart(sdk.Struct, tag_field="type", tag="text"):
    text: str


class ImageUrl(sdk.Struct):
    url: Annotated[str, Meta(description="A data: URL (base64) or a file the server may read")]
    detail: str | None = None


class ImagePart(sdk.Struct, tag_field="type", tag="image_url"):
    """Needs a vision model (or a chat plugin that turns it into text); otherwise a 400."""

    image_url: ImageUrl


class InputAudio(sdk.Struct):
    data: Annotated[str, Meta(description="Base64 audio")]
    format: str = "wav"


class AudioPart(sdk.Struct, tag_field="type", tag="input_audio"):
    """Needs a model that takes audio; otherwise a 400."""

    input_audio: InputAudio


Part = Union[TextPart, ImagePart, AudioPart]


class CalledFunction(sdk.Struct):
    name: str
    arguments: Annotated[Union[str, dict[str, Any]], Meta(description="JSON text (or an object)")] = "{}"


class ToolCall(sdk.Struct):
    function: CalledFunction
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessage(sdk.Struct):
    """One turn. ``developer`` is read as ``system``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Part], None] = None
    tool_calls: Annotated[list[ToolCall], Meta(description="An assistant turn's calls")] | None = None
    tool_call_id: Annotated[str, Meta(description="A tool turn's call id")] | None = None
    name: Annotated[str, Meta(description="A tool turn's function name")] | None = None
    origin: Annotated[Literal["tool", "client"], Meta(description="Where the text came from (never a RAG or "
                                                                  "memory query when set)")] | None = None
    untrusted_spans: Annotated[list[tuple[int, int]], Meta(description="[start, end) character ranges of "
                                                                       "untrusted text (clamped)")] | None = None


class FunctionSpec(sdk.Struct):
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="Unique among the tools")]
    description: str | None = None
    parameters: Annotated[dict[str, Any], Meta(description="A JSON schema for the arguments (keywords that cannot "
                                                           "be enforced are left out)")] | None = None
    strict: bool | None = None


class FunctionTool(sdk.Struct):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(sdk.Struct):
    name: str


class NamedChoice(sdk.Struct):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(sdk.Struct):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[ -~]+$")] | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(sdk.Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Annotated[JsonSchemaSpec, Meta(description="Required with type json_schema")] | None = None


class StreamOptions(sdk.Struct):
    include_usage: bool | None = None


class TemplateKwargs(sdk.Struct):
    enable_thinking: bool | None = None


Number = float


class _Sampling(sdk.Struct, kw_only=True):
    model: ModelName | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: Annotated[MaxTokens, Meta(description="max_tokens' other name; both must agree")] | None \
        = None
    n: Annotated[int, Meta(ge=1, le=1, description="One choice per request")] | None = None
    temperature: Annotated[Number, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Meta(ge=0, le=1)] | None = None
    top_k: int | None = None
    min_p: Annotated[Number, Meta(ge=0, le=1)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**32 - 1)] | None = None
    presence_penalty: Annotated[Number, Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Meta(ge=-2, le=2)] | None = None
    repeat_penalty: Annotated[Number, Meta(ge=0)] | None = None
    stop: Annotated[Stop, Meta(description=f"At most {MAX_STOPS} sequences of at most {MAX_STOP_CHARS} characters "
                                           "(400 past either)")] | None = None
    cache_prompt: bool | None = None
    spec_source: Annotated[Literal["off", "ngram", "draft", "mtp"],
                           Meta(description="Speculative drafting for this request: off, ngram, draft or mtp; "
                                            "unset: the engine's setting. usage.speculation reports it")] | None = None
    return_tokens_as_token_ids: bool | None = None
    grammar: Annotated[str, Meta(max_length=MAX_GRAMMAR_BYTES, description="GBNF (or Lark); 400 invalid_grammar "
                                                                           "when it does not compile")] | None = None
    grammar_lazy: bool | None = None
    grammar_triggers: Annotated[list[Any], Meta(max_length=1, description="One trigger word, with grammar_lazy")] \
        | None = None
    num_ctx: Annotated[int, Meta(ge=1, le=MAX_NUM_CTX, description="The context window to serve with")] | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    """POST /v1/chat/completions. With logprobs (or allowed_token_ids) and max_tokens 1 it is a
    scoring request (see the steering spec's scoring mode)."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES,
                                                description=f"At most {MAX_MESSAGES:,} (400 limit_exceeded "
                                                            "past it)")]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20, description="Needs logprobs: true")] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=MAX_TOOLS, description=f"At most {MAX_TOOLS} (400 "
                                                                                "invalid_tools past it)")] | None \
        = None
    tool_choice: Union[Literal["auto", "none", "required"], NamedChoice, None] = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    reasoning_effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]


class CompletionRequest(_Sampling, kw_only=True):
    """POST /v1/completions."""

    prompt: Annotated[Union[str, Annotated[list[str], Meta(min_length=1)]],
                      Meta(description="A prompt (several are served in scoring mode only)")]
    echo: bool | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    add_special_tokens: bool | None = None


class EmbeddingRequest(sdk.Struct, kw_only=True):
    """POST /v1/embeddings."""

    input: Annotated[Union[Annotated[str, Meta(min_length=1)],
                           Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)]],
                     Meta(description="400 empty_input for an empty list or an empty text")]
    model: ModelName | None = None
    encoding_format: Literal["float", "base64"] | None = None


class RerankDocument(sdk.Struct):
    text: str


class RerankRequest(sdk.Struct, kw_only=True):
    """POST /v1/rerank."""

    query: str
    documents: Annotated[list[Union[str, RerankDocument]], Meta(min_length=1)]
    model: ModelName | None = None
    top_n: Annotated[int, Meta(ge=1)] | None = None
    return_documents: bool | None = None


GENERATION_ERRORS = {
    400: "A field out of range or that cannot be honoured (field_not_honoured, invalid_tools, invalid_grammar, "
         "response_format_unsupported, limit_exceeded, ...)",
    413: "The prompt leaves no room for a reply in the model's window (context_length_exceeded), or a body over "
         "max_body_bytes",
    404: "An unknown model (model_not_found)",
    422: "A field of the wrong type (each one named in errors)",
    503: "No model can be loaded, or the model is busy (model_busy, model_not_loaded, insufficient_memory)",
}
EMBEDDING_ERRORS = {
    400: "encoding_format not float or base64, or an empty input (empty_input)",
    413: "An input past the model's window (context_length_exceeded), or a body over max_body_bytes",
    404: "An unknown model (model_not_found)",
    422: "A field of the wrong type",
    503: "No model can be loaded, or the model is busy",
}
RERANK_ERRORS = {
    400: "A field that cannot be honoured",
    404: "An unknown model (model_not_found)",
    422: "A field of the wrong type, or a model with no classifier head (no_classifier_head)",
    503: "No model can be loaded, or the reranker failed (reranker_failed)",
}
