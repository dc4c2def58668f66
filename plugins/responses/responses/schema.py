"""The request body of POST /v1/responses, as the OpenAPI document describes it (``body=``).
The route reads its body itself (request.py); this model documents that reading. A field of
the wrong type is a 400 here (the Responses API has no 422); a field not listed is passed
to the chat plugins and otherwise has no effect."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from localm import sdk

from .request import INCLUDE_NO_EFFECT, LOGPROBS, MAX_ITEMS

Meta = sdk.Meta


class InputText(sdk.Struct, tag_field="type", tag="input_text"):
    text: str


class OutputText(sdk.Struct, tag_field="type", tag="output_text"):
    text: str


class InputImage(sdk.Struct, tag_field="type", tag="input_image"):
    """Needs a vision model; otherwise a 400."""

    image_url: Annotated[str, Meta(description="A URL or a data: URL (file ids are not served)")]
    detail: str | None = None


class Refusal(sdk.Struct, tag_field="type", tag="refusal"):
    refusal: str


ContentPart = Union[InputText, OutputText, InputImage, Refusal]


class InputMessage(sdk.Struct, tag_field="type", tag="message", kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]


class FunctionCallItem(sdk.Struct, tag_field="type", tag="function_call", kw_only=True):
    name: str
    call_id: str
    arguments: Union[str, dict[str, Any]] = "{}"


class FunctionCallOutput(sdk.Struct, tag_field="type", tag="function_call_output", kw_only=True):
    call_id: str
    output: Union[str, list[Union[InputText, InputImage]]] = ""


InputItem = Union[InputMessage, FunctionCallItem, FunctionCallOutput]


class ResponsesFunctionTool(sdk.Struct, kw_only=True):
    """A function tool (built-in tools are a 400)."""

    type: Literal["function"]
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedChoice(sdk.Struct, kw_only=True):
    type: Literal["function"]
    name: str


class ResponsesFormat(sdk.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[ -~]+$")] | None = None
    schema: Annotated[dict[str, Any], Meta(description="With type json_schema")] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponsesText(sdk.Struct, kw_only=True):
    format: ResponsesFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesReasoning(sdk.Struct, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(sdk.Struct, kw_only=True):
    """POST /v1/responses: input (or previous_response_id) is required. An input item with a role
    and no type is a message."""

    input: Union[Annotated[str, Meta(min_length=1)], Annotated[list[InputItem], Meta(max_length=MAX_ITEMS)], None] \
        = None
    model: str | None = None
    instructions: str | None = None
    previous_response_id: Annotated[str, Meta(min_length=1, description="A stored response of this key")] | None \
        = None
    store: bool | None = None
    stream: bool | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    tools: Annotated[list[ResponsesFunctionTool], Meta(max_length=64)] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], ResponsesNamedChoice, None] = None
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    include: list[Literal[(LOGPROBS, *INCLUDE_NO_EFFECT)]] | None = None  # type: ignore[valid-type]
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    background: Annotated[Literal[False], Meta(description="Not served: true is a 400")] | None = None
    # localm's own chat fields, passed on as they are
    top_k: int | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[float, Meta(ge=0)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**32 - 1)] | None = None
    stop: Union[Annotated[str, Meta(max_length=1024)],
                Annotated[list[Annotated[str, Meta(max_length=1024)]], Meta(max_length=16)], None] = None
    cache_prompt: bool | None = None
    spec_source: Annotated[Literal["off", "ngram", "draft", "mtp"],
                           Meta(description="Speculative drafting for this request (localm): off, ngram, draft "
                                            "or mtp; unset: the engine's setting")] | None = None


ERRORS = {400: "A field of the wrong type or value (each refusal names its param)",
          413: "A prompt past the model's window (context_length_exceeded), or a body over max_body_bytes",
          404: "An unknown model, or a previous_response_id not stored for this key",
          503: "No model can be loaded, or the model is busy"}
