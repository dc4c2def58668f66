from __future__ import annotations

import time
from typing import Any

import humanize  # the plugin's pip requirement; `localm plugin install-deps hello` installs it


def greet(name: str, settings: dict[str, Any]) -> str:
    text = f"{settings['greeting']}, {name}!"
    return text.upper() if settings["shout"] else text


def uptime(started: float) -> str:
    return f"up for {humanize.naturaldelta(time.time() - started)}"
