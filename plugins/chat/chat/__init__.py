"""The chat plugin: the chat service every surface renders (``host.chat``, typed by
``localm.sdk.chat.ChatService``: :mod:`.service`), and the ``localm run`` command (:mod:`.cli`).

The service reads a request (an OpenAI chat or completions body, which every surface
translates its client's request into), runs the chat pipeline (inlet hooks, template,
compaction, the engine, stop sequences, constrained decoding, outlet hooks) and hands the
surface a generation to render; it also embeds, reranks and scores. The surfaces are
plugins of their own: openai (/v1/chat/completions, /v1/completions, /v1/embeddings,
/v1/rerank), ollama, anthropic and responses. The settings here cap and compact every
surface's requests.
"""

from __future__ import annotations

import attrs
from localm import sdk

from . import compaction
from .service import ChatService


@attrs.frozen
class Settings:
    task_max_tokens: int = sdk.setting(256, min=0, description="The reply cap of a front end's background task (a "
                                                               "title, tags or follow-ups) that sends no max_tokens "
                                                               "(0: none)")
    default_max_tokens: int = sdk.setting(0, min=0, description="The reply cap of any other request that sends no "
                                                                "max_tokens (0: none: the reply may fill the window)")
    compaction_max_tokens: int = sdk.setting(compaction.MAX_TOKENS, min=0,
                                             description="The most tokens of older conversation one request may have "
                                                         "summarised to fit the context window (summaries kept from "
                                                         "earlier turns cost nothing); a conversation that needs more "
                                                         "is a 413 before any of it is read (0: never compact)")
    compaction_timeout: float = sdk.setting(compaction.TIMEOUT, min=1.0,
                                            description="The most seconds one request's compaction may take (a 413 "
                                                        "past it)")


@sdk.hookimpl
def register_settings(register):
    register(Settings)


@sdk.hookimpl
def startup(host, plugin):
    host.provide("chat", ChatService(host, lambda: plugin.settings), plugin=plugin.name)


@sdk.hookimpl
def register_routes(register):
    from . import routes
    register(*routes.HANDLERS)


@sdk.hookimpl
def register_commands(register):
    from .cli import run  # the `localm run` chat, imported only when the CLI asks for it

    register(run)
