"""Knowledge (RAG): collections of files indexed for hybrid search, answered from in chats.

Routes /api/rag/* (scope ``rag``); a ``chat_inlet`` hook that adds sources to any chat that
asks (``"rag": {...}``) or to every chat when ``default_collections`` is set; CLI commands
``localm rag ...``. Storage, retrieval and the chat side are in the modules beside this one;
docs/rag.md describes them for users.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
from localm import sdk

from .service import DEFAULT_EMBEDDER, Knowledge

@attrs.frozen
class Settings:
    embedding_model: str = sdk.setting(
        DEFAULT_EMBEDDER, owner_only=True,
        description="The registered embedding model every vector is computed with (change it with POST "
                    "/api/rag/embedding, which says which collections need re-embedding)")
    default_collections: list[str] = sdk.setting(
        factory=list, description="Collections every chat searches when the request names none (empty: only "
                                  "chats that ask with a rag field)")
    default_k: int = sdk.setting(4, min=1, max=20, description="Sources a chat gets when it does not say")
    rerank: bool = sdk.setting(False, description="Rerank search results with a registered reranker")
    rerank_model: str | None = sdk.setting(None, description="The reranker to use (needed when several are "
                                                             "registered)")
    rerank_candidates: int = sdk.setting(20, min=1, max=100, description="How many fused results the reranker "
                                                                         "sees")
    relevance_floor: float | None = sdk.setting(
        None, min=0.0, max=1.0, description="The cosine similarity relevant_only keeps hits above (empty: each "
                                            "collection's own, calibrated when it is indexed)")
    chunk_size: int = sdk.setting(1000, min=200, max=8000, description="Characters per chunk")
    chunk_overlap: int = sdk.setting(150, min=0, max=2000, description="Characters consecutive chunks share")
    allowed_roots: list[str] = sdk.setting(
        factory=list, owner_only=True, description="Folders the owner may index without consent (empty: the "
                                                   "home folder)")
    denied_roots: list[str] = sdk.setting(factory=list, owner_only=True, description="Folders never indexed")
    chroma_url: str | None = sdk.setting(
        None, owner_only=True, description="A Chroma server (http://host:port, e.g. `chroma run`) to keep the "
                                           "vectors on instead of the embedded store (empty: embedded); chunk "
                                           "text and the keyword index stay in this data folder")
    indexing_mode: Literal["ask", "strict", "open"] = sdk.setting(
        "ask", owner_only=True, description="Outside allowed_roots: ask (409 needs_consent until the owner "
                                            "consents), strict (refused), open (allowed)")


@sdk.hookimpl
def create_service(host: Any, plugin: Any) -> Knowledge:
    """The collections (routes: ``sdk.service_of(request)``; other plugins: ``host.service("rag")``)."""
    return Knowledge(host, plugin)


@sdk.hookimpl
def register_settings(register: Any) -> None:
    register(Settings)


@sdk.hookimpl
def register_scopes(register: Any) -> None:
    register("rag", "Create, fill and search knowledge collections, and use them in chats")


@sdk.hookimpl
def register_routes(register: Any) -> None:
    from . import routes
    register(*routes.HANDLERS)


@sdk.hookimpl
async def chat_inlet(request: Any, context: Any, plugin: Any) -> Any:
    k = plugin.service
    if not isinstance(request, dict):
        return None
    from . import chat
    return await chat.inlet(k, request, context)


@sdk.hookimpl
def register_commands(register: Any) -> None:
    from . import cli
    register(cli.rag)
