"""The example plugin: ``GET /hello/{name}`` and ``localm hello NAME``."""

from __future__ import annotations

import attrs
import click

from localm import sdk

from .greeting import greet, uptime


@attrs.frozen
class Settings:
    greeting: str = sdk.setting("Hello", description="The word the greeting starts with")
    shout: bool = sdk.setting(False, description="Greet in capitals")


@sdk.get("/hello/{name:str}", summary="Greet someone")  # guarded by the plugin's scope, "hello"
async def hello(request: sdk.Request, name: str) -> dict[str, str]:
    plugin = sdk.plugin_of(request)
    return {"greeting": greet(name, plugin.settings), "uptime": uptime(sdk.host_of(request).started_at)}


@sdk.hookimpl
def register_settings(register):
    register(Settings)


@sdk.hookimpl
def register_scopes(register):
    register("hello", "Be greeted by the hello plugin")


@sdk.hookimpl
def register_routes(register):
    register(hello)


@sdk.hookimpl
def register_commands(register, plugin):
    @click.command("hello")
    @click.argument("name")
    def hello_command(name: str) -> None:
        """Print a greeting (the hello plugin's example command)."""
        click.echo(greet(name, plugin.settings))

    register(hello_command)
