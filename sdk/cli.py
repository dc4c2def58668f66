"""What a plugin's CLI command needs beyond ``sdk.connect()`` and ``sdk.server()``.

A command registered by ``register_commands`` imports it as ``from localm.sdk import cli``.
Importing it loads nothing the ``localm`` command has not loaded already: what a function
needs is imported when it is called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from localm.kernel.client import ServerClient, command_data_dir
from localm.kernel.client import ensure_server as _ensure_server


def data_dir() -> Path:
    """The data directory the ``localm`` command was given (``--data-dir``, else
    ``LOCALM_HOME``, else ``~/.localm``)."""
    return command_data_dir()


def ensure_server(data_dir: str | Path | None = None, *,
                  timeout: float | None = None) -> tuple[ServerClient, str | None]:
    """``(client, started)``: a client of the server running on ``data_dir`` (default: the
    command's), or of one started now as a background ``localm serve`` that outlives the
    command, its output in ``<data dir>/serve.log``. ``started`` is a line saying so (its url,
    pid and log) for the command to print, or None when a server was running. A 500 or 504
    ``server_failed`` LocalmError when it exits or does not answer within ``timeout`` seconds
    (default 120)."""
    return _ensure_server(data_dir, timeout=timeout)


def model_known(model: str | None, data_dir: str | Path | None = None) -> bool:
    """Whether asking for ``model`` is worth starting a server for: the registry holds it (an
    id or an alias), or it is None (the server's active model) or the default model (a first
    ``localm serve`` registers it), or the registry cannot be read (the server will say why).
    Check it before :func:`ensure_server`, so a mistyped name starts nothing."""
    from localm.kernel.cli import model_known as known

    return known(model, command_data_dir(data_dir))


def complete_models(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """Shell completion of registered model ids and aliases, for a click argument or option:
    ``@click.argument("model", shell_complete=cli.complete_models)``."""
    from localm.kernel.cli import complete_models as complete

    return complete(ctx, param, incomplete)


def model_card(model: str, data_dir: str | Path | None = None) -> dict[str, Any]:
    """What ``localm show MODEL --json`` prints of a registered model, without the server's
    ``loaded`` and ``engine``: its registry entry plus ``architecture``, ``parameter_count``,
    ``context_window``, ``quantization``, ``capability_names``, ``template``, ``license`` and
    the default sampling ``parameters``. A 404 LocalmError when no model of that name is
    registered."""
    from localm.kernel.modelcard import card
    from localm.kernel.models import Registry

    return card(Registry(command_data_dir(data_dir)).get(model))


def default_parameters() -> dict[str, Any]:
    """The sampling parameters a request gets when it sets none (temperature, top_p...)."""
    from localm.kernel.modelcard import default_parameters as defaults

    return defaults()


def human_count(n: int | None) -> str:
    """A parameter count as people say it: 134.5M, 1.2B ("unknown" for None or 0)."""
    from localm.kernel.modelcard import human_count as count

    return count(n)


__all__ = ["data_dir", "ensure_server", "model_known", "complete_models", "model_card", "default_parameters",
           "human_count"]
