"""The request bodies of the knowledge routes, as the OpenAPI document describes them
(``body=``). The routes read their bodies themselves (routes.py); these models document that
reading. An empty body reads as ``{}``; a body that is not a JSON object is a 400."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from localm import sdk

from .service import MAX_PATHS

Meta = sdk.Meta

#: A collection name (store.NAME): checked by the routes, 400 invalid_collection_name otherwise.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"
NAME = {"name": {"pattern": NAME_PATTERN, "maxLength": 63}}
Name = Annotated[str, Meta(pattern=NAME_PATTERN, max_length=63, description="1 to 63 letters, digits, - and _, "
                                                                            "starting with a letter or digit")]
Path = Annotated[str, Meta(min_length=1, pattern=r"\S")]


class NewCollection(sdk.Struct, kw_only=True):
    name: Name


class AddPaths(sdk.Struct, kw_only=True):
    """Files and folders on this host (a key confined by rag_roots: inside them)."""

    paths: Union[Path, Annotated[list[Path], Meta(min_length=1, max_length=MAX_PATHS)]]
    embed: bool | None = None
    reindex: bool | None = None
    consent: Annotated[bool, Meta(description="Index a folder the policy asks consent for")] | None = None


class UploadedFile(sdk.Struct, kw_only=True):
    filename: Path
    content_b64: Annotated[str, Meta(description="The file's bytes, base64 (at most 30 MB decoded: 413)")]


class Upload(sdk.Struct, kw_only=True):
    files: Annotated[list[UploadedFile], Meta(min_length=1, max_length=MAX_PATHS)]
    embed: bool | None = None
    reindex: bool | None = None


class Query(sdk.Struct, kw_only=True):
    query: Path
    k: Annotated[float, Meta(description="How many hits (clamped to 1..20)")] | None = None
    rerank: bool | None = None
    context: Annotated[str, Meta(description="The conversation before the question")] | None = None
    mode: Literal["hybrid", "vector", "lexical"] | None = None
    relevant_only: bool | None = None


class Repair(sdk.Struct, kw_only=True):
    embed: bool | None = None
    confirm: bool | None = None


class RemoveDoc(sdk.Struct, kw_only=True):
    path: Path


class Extract(sdk.Struct, kw_only=True):
    filename: Path
    content_b64: Annotated[str, Meta(description="The file's bytes, base64 (at most 30 MB decoded: 413)")]
    max_chars: Annotated[int, Meta(description="Clamped to 500..200,000")] | None = None


class ChooseEmbedder(sdk.Struct, kw_only=True):
    model: Path
    confirm: bool | None = None


BODY = {400: "A field of the wrong type or value (invalid_parameter, ...)"}
COLLECTION = {**BODY, 400: "A field of the wrong type or value, or an invalid collection name "
                           "(invalid_collection_name)", 403: "A key confined by rag_roots, outside them",
              404: "No such collection (collection_not_found)",
              409: "The collection cannot be read (another process wrote it)"}
