"""The bug-report proxy: a small HTTP service, at the ``bugreport_upload_url`` setting, that
stands between this server and the project's issue tracker.

Its protocol (paths are relative to the URL; ``Authorization: Bearer <bugreport_upload_token>``
when that setting is not empty):

- ``GET /issues?state=open|closed|all`` answers 200 with a JSON list of issues, each an
  object with ``number``, ``title``, ``state``, ``url``, ``created_at``, ``updated_at`` and
  ``labels`` (a list of strings); other fields are ignored.
- ``POST /issues`` with ``{"title", "body"}`` (JSON) files an issue and answers 2xx with
  ``{"url": ...}`` (the new issue's address; optional). A 429 means "too many reports":
  its ``Retry-After`` header (seconds) says when to try again.

Every call is bounded: a time limit for the whole exchange, a cap on the answer's size, and
on the number of issues kept. Redirects are not followed and no proxy from the environment
is used. Errors never name the URL or the token (a key that may not read those settings
sees the errors).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import time
from typing import Any
from urllib.parse import urlsplit

import attrs
import httpx

log = logging.getLogger("localm")

#: Seconds a whole exchange with the proxy may take.
TIMEOUT = 10.0
#: The largest answer read from the proxy.
MAX_ANSWER_BYTES = 1024 * 1024
#: Issues kept from one listing.
MAX_ISSUES = 100
#: Characters kept of an issue's text fields.
MAX_FIELD_CHARS = 500
#: The longest wait a 429 may ask for that is passed on (seconds).
MAX_RETRY_AFTER = 86400
DEFAULT_RETRY_AFTER = 60


class ProxyError(Exception):
    """A failed exchange: ``stage`` (connect, timeout, proxy) and a sentence without the URL."""

    def __init__(self, stage: str, message: str, *, status: int | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message
        self.status = status
        self.retry_after = retry_after


@attrs.frozen
class Endpoint:
    url: str
    token: str


def endpoint(config: Any) -> Endpoint | None:
    """The configured proxy, or None when ``bugreport_upload_url`` is empty."""
    url = config.get("bugreport_upload_url")
    token = config.get("bugreport_upload_token")
    if not isinstance(url, str) or not url.strip():
        return None
    return Endpoint(url.strip().rstrip("/"), token.strip() if isinstance(token, str) else "")


def _check_url(url: str) -> None:
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ProxyError("configure", "bugreport_upload_url is not an http or https URL")


async def _exchange(ep: Endpoint, method: str, path: str, **kwargs: Any) -> tuple[int, dict[str, str], bytes]:
    """One request to the proxy: (status, headers, body) with the body capped."""
    _check_url(ep.url)
    # identity: the answer's size is bounded as it arrives, never a compressed one decoded later
    headers = {"Accept": "application/json", "Accept-Encoding": "identity", "User-Agent": "localm"}
    if ep.token:
        headers["Authorization"] = f"Bearer {ep.token}"

    async def run() -> tuple[int, dict[str, str], bytes]:
        async with httpx.AsyncClient(timeout=TIMEOUT, follow_redirects=False, trust_env=False) as client:
            async with client.stream(method, ep.url + path, headers=headers, **kwargs) as r:
                chunks: list[bytes] = []
                size = 0
                async for chunk in r.aiter_raw():
                    size += len(chunk)
                    if size > MAX_ANSWER_BYTES:
                        raise ProxyError("proxy", f"The bug-report proxy's answer is over {MAX_ANSWER_BYTES} bytes",
                                         status=r.status_code)
                    chunks.append(chunk)
                return r.status_code, dict(r.headers), b"".join(chunks)

    try:
        return await asyncio.wait_for(run(), TIMEOUT)
    except ProxyError:
        raise
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise ProxyError("timeout", f"The bug-report proxy did not answer within {TIMEOUT:g} seconds") from None
    except httpx.HTTPError as exc:
        raise ProxyError("connect", f"The bug-report proxy could not be reached ({type(exc).__name__})") from None
    except Exception as exc:  # a malformed URL httpx refuses, a decoding failure: a failed call, not a 500
        log.warning("bug-report proxy call failed: %s", type(exc).__name__)
        raise ProxyError("connect", f"The bug-report proxy could not be reached ({type(exc).__name__})") from None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value) if isinstance(value, (int, float)) else None
    if text is None:
        return None
    text = "".join(c if c.isprintable() else " " for c in text)  # a lone surrogate is not printable either
    return text[:MAX_FIELD_CHARS]


def _issue(item: Any) -> dict[str, Any] | None:
    if not isinstance(item, dict):
        return None
    number = item.get("number")
    labels = item.get("labels")
    names: list[str] = []
    for label in (labels if isinstance(labels, list) else [])[:20]:
        name = label.get("name") if isinstance(label, dict) else label  # GitHub's shape, or plain names
        text = _text(name) if isinstance(name, str) else None
        if text:
            names.append(text)
    return {"number": number if isinstance(number, int) and not isinstance(number, bool) else None,
            "title": _text(item.get("title")) or "",
            "state": _text(item.get("state")),
            "url": _text(item.get("url")),
            "created_at": _text(item.get("created_at")),
            "updated_at": _text(item.get("updated_at")),
            "labels": names}


async def list_issues(ep: Endpoint, state: str) -> list[dict[str, Any]]:
    """The proxy's issues in ``state`` (at most MAX_ISSUES, each reduced to known fields)."""
    status, _, body = await _exchange(ep, "GET", "/issues", params={"state": state})
    if status != 200:
        raise ProxyError("proxy", f"The bug-report proxy answered {status}", status=status)
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deeply to parse
        raise ProxyError("proxy", "The bug-report proxy's answer is not JSON") from None
    if not isinstance(value, list):
        raise ProxyError("proxy", "The bug-report proxy's answer is not a list of issues")
    return [issue for issue in map(_issue, value[:MAX_ISSUES]) if issue is not None]


def retry_after(value: str | None) -> int:
    """A Retry-After header as seconds from now (seconds or an HTTP date), bounded."""
    if value:
        value = value.strip()
        if value.isdigit():
            return min(int(value), MAX_RETRY_AFTER)
        try:
            when = email.utils.parsedate_to_datetime(value)
            return max(0, min(int(when.timestamp() - time.time()), MAX_RETRY_AFTER))
        except (TypeError, ValueError, OverflowError):
            pass
    return DEFAULT_RETRY_AFTER


async def file_issue(ep: Endpoint, title: str, body: str) -> str | None:
    """File an issue; the new issue's URL when the proxy gave one."""
    status, headers, answer = await _exchange(ep, "POST", "/issues", json={"title": title, "body": body})
    if status == 429:
        raise ProxyError("proxy", "The bug-report proxy is refusing reports for now (too many requests)",
                         status=429, retry_after=retry_after(headers.get("retry-after")))
    if not 200 <= status < 300:
        raise ProxyError("proxy", f"The bug-report proxy answered {status}", status=status)
    try:
        value = json.loads(answer) if answer.strip() else {}
    except (ValueError, RecursionError):
        value = {}
    url = value.get("url") if isinstance(value, dict) else None
    return _text(url) if isinstance(url, str) else None
