"""The anthropic plugin: POST /v1/messages and /v1/messages/count_tokens (the Anthropic Messages API).

A thin surface over the chat service (``host.chat``): the request is read into
an OpenAI chat body (``translate``), generated on the one chat path, and rendered as an
Anthropic message or Anthropic's server-sent events (``render``). Errors on these routes
take Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import time
from typing import Any

from localm import sdk

from . import render, schema
from .translate import to_chat_request

ROUTE = "anthropic"


async def _body(request: sdk.Request) -> Any:
    return await sdk.json_body(request, require_object=False, missing="The body is not valid JSON")


@sdk.post("/v1/messages", scope=None, access="inference", error_family="anthropic",
          summary="Anthropic Messages", body=schema.AnthropicMessagesRequest, errors=schema.ERRORS)
async def messages(request: sdk.Request) -> Any:
    received = time.perf_counter()
    chat = sdk.host_of(request).chat
    raw = await _body(request)
    asked = to_chat_request(raw)
    gen = await chat.chat(asked, route=ROUTE, request=request, received=received)
    ident = render.message_id()
    if asked.body["stream"]:
        return sdk.EventStream(render.events(gen, chat, ident),
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **gen.headers})
    reply = await gen.reply()
    outcome = gen.outcome
    if outcome.finish_reason == "error":
        raise sdk.LocalmError(500, outcome.error or "Generation failed")
    message = render.message(ident, gen.model, reply.text, "".join(reply.reasoning), reply.calls, outcome)
    return sdk.Response({**gen.extra, **message}, headers=gen.headers)


@sdk.post("/v1/messages/count_tokens", scope=None, access="inference", error_family="anthropic",
          summary="Anthropic token count", body=schema.AnthropicCountRequest, errors=schema.ERRORS)
async def count_tokens(request: sdk.Request) -> sdk.Response:
    chat = sdk.host_of(request).chat
    raw = await _body(request)
    asked = to_chat_request(raw, counting=True)
    headers: dict[str, str] = {}
    tokens = await chat.count_tokens(asked, route="anthropic.count_tokens", request=request, headers=headers)
    routed = {k: v for k, v in headers.items() if k == "X-Localm-Model-Routing"}
    return sdk.Response({"input_tokens": tokens}, headers=routed)


def anthropic_error(status: int, detail: str, code: str | None, extra: dict[str, Any]) -> sdk.Response:
    """Anthropic's error shape; a body that fails validation (the chat service's 422) is a 400."""
    if status == 422:
        status = 400
    return sdk.Response(render.error_body(status, detail), status_code=status)


@sdk.hookimpl
def startup(host, plugin):
    host.register_error_renderer("anthropic", anthropic_error, plugin=plugin.name)


@sdk.hookimpl
def register_routes(register):
    register(messages, count_tokens)
