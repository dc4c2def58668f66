"""localm's SDK: the one package plugins import.

A plugin is a folder with a ``plugin.toml`` and a module that implements hooks::

    from localm import sdk

    @sdk.get("/hello/{name:str}")
    async def hello(name: str) -> dict:
        return {"greeting": f"Hello, {name}"}

    @sdk.hookimpl
    def register_routes(register):
        register(hello)

Plugins import ``localm.sdk`` (and their own modules) only: never ``localm.kernel``
and never another plugin. They reach other plugins through host services
(``host.service(name)``).
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, Router
from litestar.response import Stream
from msgspec import Meta, Struct

from localm.kernel.app import principal_of as caller
from localm.kernel.auth import Principal
from localm.kernel.client import ServerClient, ServerError, connect, server
from localm.kernel.errors import LocalmError
from localm.kernel.host import Host
from localm.kernel.hookspecs import hookimpl, hookspec
from localm.kernel.jobs import JobCancelled, JobContext
from localm.kernel.logs import annotate
from localm.kernel.models import ModelEntry, ModelFormat, ModelSource, fit_adapters, model_id
from localm.kernel.plugins import PluginContext
from localm.kernel.routes.common import EventStream, json_body, sse
from localm.kernel.routing import delete, get, head, patch, post, put, route
from localm.kernel.settings import FieldSpec, setting

from . import media
from .fields import report_ignored, strict_mode
from .text import defang


def host_of(request: Request) -> Host:
    """The host services, from inside a route handler."""
    return request.app.state.kernel.host


def plugin_of(request: Request) -> PluginContext:
    """The context of the plugin that owns this route (its settings, data dir, jobs)."""
    kernel = request.app.state.kernel
    name = request.route_handler.opt.get("plugin")
    if name is None or name not in kernel.plugins.plugins:
        raise LocalmError(500, "This route does not belong to a plugin")
    return kernel.plugins.context(kernel.plugins.plugins[name])


def service_of(request: Request) -> Any:
    """The service of the plugin that owns this route (what its ``create_service`` hook made);
    a 503 ``service_unavailable`` while the plugin is not running."""
    return plugin_of(request).service


__all__ = [
    "hookimpl", "hookspec",
    # routes
    "get", "post", "put", "patch", "delete", "head", "route", "Request", "Response", "Router", "Stream", "EventStream", "sse",
    "caller", "Principal", "host_of", "plugin_of", "service_of",
    # a request's JSON body; the ignored-fields report and X-Localm-Strict
    "json_body", "media", "report_ignored", "strict_mode",
    # the request log: what a request's line says beyond method, path, status and time
    "annotate",
    # request bodies for the OpenAPI document (body=, errors= on a route)
    "Meta", "Struct",
    # errors
    "LocalmError",
    # untrusted text quoted into a prompt
    "defang",
    # settings
    "setting", "FieldSpec",
    # jobs
    "JobContext", "JobCancelled",
    # host
    "Host", "PluginContext",
    # models: the registry's entries, and the file formats and pull sources a plugin teaches it
    "ModelEntry", "ModelFormat", "ModelSource", "model_id",
    # LoRA adapters: 400 unless each applies to a GGUF model (its architecture, its tensors)
    "fit_adapters",
    # the running server, from a CLI command
    "connect", "server", "ServerClient", "ServerError",
]
