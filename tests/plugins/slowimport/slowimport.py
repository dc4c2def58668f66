"""Importing this module announces itself and then blocks until the test creates the release
file (both in $SLOWIMPORT_DIR), for at most a minute."""

import os
import time
from pathlib import Path

from localm import sdk

_folder = Path(os.environ.get("SLOWIMPORT_DIR", "."))
(_folder / "importing").touch()
_deadline = time.monotonic() + 60
while not (_folder / "release").exists() and time.monotonic() < _deadline:
    time.sleep(0.05)


@sdk.get("/api/slowimport/ping", access="public")
async def ping() -> dict:
    return {"imported": True}


@sdk.hookimpl
def register_routes(register):
    register(ping)
