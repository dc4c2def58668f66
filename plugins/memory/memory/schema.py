"""The request bodies of the memory routes, as the OpenAPI document describes them (``body=``).
The routes read their bodies themselves (routes.py); these models document that reading.
An empty body reads as ``{}``; a body that is not a JSON object is a 400."""

from __future__ import annotations

from typing import Annotated, Literal

from localm import sdk

from .store import KINDS

Meta = sdk.Meta

Text = Annotated[str, Meta(pattern=r"\S", description="A fact (blank after cleaning: 400 empty_text)")]
Importance = Annotated[float, Meta(ge=0, le=1)]
#: Fact, correction and archive ids are random hex (a route answers 404 for any it does not hold).
ID = Annotated[str, Meta(max_length=200)]


class BulkEdit(sdk.Struct, kw_only=True):
    text: Annotated[str, Meta(description="One fact per line; the memory becomes these lines")]


class Append(sdk.Struct, kw_only=True):
    text: Text
    importance: Importance | None = None
    kind: Literal[KINDS] | None = None  # type: ignore[valid-type]


class Edit(sdk.Struct, kw_only=True):
    """Send text, importance or both (neither: 400)."""

    text: Text | None = None
    importance: Importance | None = None


WRITE = {400: "A field of the wrong type or value", 403: "Memory is in privacy mode (privacy_mode)",
         413: "Past the memory's caps on facts or characters"}
