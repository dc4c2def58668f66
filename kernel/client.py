"""How CLI commands reach a running server: its address and attach token from
``<data dir>/server.json``, checked live before use."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import httpx

from .datadir import server_file


class ServerError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class ServerClient:
    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=None)

    @classmethod
    def find(cls, data_dir: Path) -> "ServerClient | None":
        """The server running on this data dir, or None when there is none."""
        try:
            info = json.loads(server_file(data_dir).read_text())
            pid, url, token = int(info["pid"]), str(info["url"]), str(info["token"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        try:
            httpx.get(f"{url}/health", timeout=3.0)
        except httpx.HTTPError:
            return None
        return cls(url, token)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ServerError(response.status_code, str(detail))
        return response.json()

    def events(self, path: str) -> Iterator[dict[str, Any]]:
        """Follow a server-sent event stream, yielding each event's JSON."""
        with self.http.stream("GET", path) as response:
            if response.status_code >= 400:
                response.read()
                raise ServerError(response.status_code, response.json().get("detail", response.text))
            for line in response.iter_lines():
                if line.startswith("data: "):
                    yield json.loads(line[6:])
