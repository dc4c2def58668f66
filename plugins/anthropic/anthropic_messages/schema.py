"""The request bodies of /v1/messages and /v1/messages/count_tokens, as the OpenAPI document
describes them (``body=``). The routes read their bodies themselves (translate.py); these
models document that reading. A field not listed is passed to the chat plugins (a plugin's
own field, such as ``rag``) and otherwise has no effect."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from localm import sdk

from .translate import MAX_MESSAGES

Meta = sdk.Meta


class AnthropicText(sdk.Struct, tag_field="type", tag="text"):
    text: str


class AnthropicBase64Source(sdk.Struct, tag_field="type", tag="base64"):
    media_type: str
    data: str


class AnthropicUrlSource(sdk.Struct, tag_field="type", tag="url"):
    url: str


class AnthropicImage(sdk.Struct, tag_field="type", tag="image"):
    """Needs a vision model; otherwise a 400."""

    source: Union[AnthropicBase64Source, AnthropicUrlSource]


class AnthropicToolUse(sdk.Struct, tag_field="type", tag="tool_use"):
    """In an assistant turn only."""

    id: str
    name: str
    input: dict[str, Any] = {}


class AnthropicToolResult(sdk.Struct, tag_field="type", tag="tool_result"):
    """In a user turn only."""

    tool_use_id: str
    content: Union[str, list[Union[AnthropicText, AnthropicImage]], None] = None
    is_error: bool | None = None


class AnthropicThinking(sdk.Struct, tag_field="type", tag="thinking"):
    """Dropped: a model's earlier thinking is not shown to it again."""

    thinking: str = ""
    signature: str = ""


Block = Union[AnthropicText, AnthropicImage, AnthropicToolUse, AnthropicToolResult, AnthropicThinking]


class AnthropicMessage(sdk.Struct):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class AnthropicTool(sdk.Struct, kw_only=True):
    """A custom tool (server tools are a 400)."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None


class AnthropicToolChoice(sdk.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: Annotated[str, Meta(description="With type tool")] | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicThinkingConfig(sdk.Struct, kw_only=True):
    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: int | None = None


class AnthropicFormat(sdk.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class AnthropicOutputConfig(sdk.Struct, kw_only=True):
    format: AnthropicFormat | None = None
    effort: Annotated[str, Meta(description="No effect here")] | None = None


class _Messages(sdk.Struct, kw_only=True):
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1, max_length=MAX_MESSAGES)]
    model: str | None = None
    system: Union[str, list[AnthropicText], None] = None
    stop_sequences: Annotated[list[Annotated[str, Meta(max_length=1024)]], Meta(max_length=16)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_k: int | None = None
    tools: Annotated[list[AnthropicTool], Meta(max_length=64)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinkingConfig | None = None
    output_config: AnthropicOutputConfig | None = None
    mcp_servers: Annotated[list[Any], Meta(max_length=0, description="MCP connectors are not served")] | None = None
    metadata: Annotated[dict[str, Any], Meta(description="No effect here")] | None = None
    # localm's own chat fields (an SDK sends them through extra_body)
    seed: Annotated[int, Meta(ge=0, le=2**32 - 1)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[float, Meta(ge=0)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    cache_prompt: bool | None = None
    spec_source: Annotated[Literal["off", "ngram", "draft", "mtp"],
                           Meta(description="Speculative drafting for this request (localm): off, ngram, draft "
                                            "or mtp; unset: the engine's setting")] | None = None


class AnthropicMessagesRequest(_Messages, kw_only=True):
    """POST /v1/messages."""

    max_tokens: Annotated[int, Meta(ge=1, description="Required: the reply cap")]
    stream: bool | None = None


class AnthropicCountRequest(_Messages, kw_only=True):
    """POST /v1/messages/count_tokens (the same fields, without max_tokens)."""


ERRORS = {400: "A body that fails validation (invalid_request_error)",
          401: "A missing or wrong key (authentication_error)", 404: "An unknown model (not_found_error)",
          413: "A body over max_body_bytes, or a prompt past the model's window (request_too_large)",
          503: "No model can be loaded, or the model is busy (overloaded_error)"}
