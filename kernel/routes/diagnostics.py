"""Diagnostics on the base server: the changelog, the project's issues and bug reports.

GET /api/changelog reads a file this build ships; GET /api/issues and POST
/api/bug-report/send go through the bug-report proxy (:mod:`..bugproxy`) when ``net_mode``
allows it (:mod:`..netpolicy`), and answer a failure of the proxy in the body, not with a
5xx. POST /api/bug-report writes a report on this machine and never sends it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from typing import Any

from litestar import Request
from litestar.params import QueryParameter

from .. import bugproxy, bugreport, changelog, netpolicy
from ..errors import LocalmError
from ..routing import get, post
from .common import json_body, kernel_of, principal_of

log = logging.getLogger("localm")

PROXY = "the bug-report proxy"
STATES = ("open", "closed", "all")
#: Seconds a report may take to be written before the route answers 504.
SAVE_TIMEOUT = 10.0
#: The largest body POST /api/bug-report reads.
REPORT_BODY_BYTES = 256 * 1024
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


def _maintainer(k: Any) -> bool:
    """Whether a saved report can be filed with the maintainers now: a proxy is configured
    and net_mode lets the server call it."""
    return bugproxy.endpoint(k.config) is not None and netpolicy.outbound(k.config, PROXY).allowed


@get("/api/changelog", scope="config:read", summary="This build's CHANGELOG.md, without its Unreleased section")
def read_changelog(request: Request) -> dict[str, Any]:
    return changelog.read()


@get("/api/issues", scope="config:read", summary="The project's issues, through the bug-report proxy")
async def list_issues(request: Request,
                      issue_state: str | None = QueryParameter(name="state", default=None, required=False,
                                                               description="open, closed or all (the default; "
                                                                           "any other value reads as all)")
                      ) -> dict[str, Any]:
    k = kernel_of(request)
    state = issue_state if issue_state in STATES else "all"
    ep = bugproxy.endpoint(k.config)
    if ep is None:
        return {"available": False, "issues": []}
    decision = netpolicy.outbound(k.config, PROXY)
    if not decision.allowed:
        return {"available": True, "state": state, "issues": [], "error": decision.error}
    try:
        issues = await bugproxy.list_issues(ep, state)
    except bugproxy.ProxyError as exc:
        return {"available": True, "state": state, "issues": [], "error": exc.message}
    return {"available": True, "state": state, "issues": issues}


def _refuse_body(reason: str, message: str) -> Exception:
    if reason == "too_large":
        return LocalmError(413, message, code="request_too_large")
    return LocalmError(422, f"body: {message}", errors=[{"key": "body", "message": message}])


REPORT_BODY = {
    "type": "object", "title": "BugReport", "additionalProperties": False,
    "description": "description (or message) or what_happened must be non-empty; upload is refused",
    "properties": {
        "description": {"type": ["string", "null"], "maxLength": bugreport.MAX_TEXT_CHARS},
        "message": {"type": ["string", "null"], "maxLength": bugreport.MAX_TEXT_CHARS,
                    "description": "Another name for description"},
        "what_i_expected": {"type": ["string", "null"], "maxLength": bugreport.MAX_TEXT_CHARS},
        "what_happened": {"type": ["string", "null"], "maxLength": bugreport.MAX_TEXT_CHARS},
        "include_log": {"type": ["boolean", "null"], "description": "Add the server log's last lines"},
        "client": {"type": ["object", "null"], "description": "What the client says of itself: name, version, "
                   "platform, user_agent, language and screen are kept (short strings); the rest is dropped"},
    },
}


@post("/api/bug-report", scope="config:write", summary="Write a bug report and save it for review (never sent)",
      body=REPORT_BODY,
      errors={400: "upload was set, or neither description (message) nor what_happened says anything",
              403: "include_log from a caller who is not the owner",
              413: "The body is over 256 KiB",
              422: "No JSON object, or a field of the wrong type, too long or unknown",
              500: "The report could not be written", 504: "Writing the report took too long"})
async def create_bug_report(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    caller = principal_of(request)
    body = await json_body(request, max_bytes=REPORT_BODY_BYTES, refuse=_refuse_body)
    req = bugreport.parse(body)
    if req.include_log and not caller.is_owner:  # other callers' requests are in it: paths, key ids, addresses
        raise LocalmError(403, "include_log is the owner's: the server log holds every caller's requests",
                          code="owner_only")
    text = await asyncio.to_thread(bugreport.build, k, req)
    keep = k.config.get("keep_diagnostics")
    keep = keep if isinstance(keep, int) and not isinstance(keep, bool) and keep > 0 else 50
    try:
        path = await asyncio.wait_for(asyncio.to_thread(bugreport.save, k.data_dir, text, keep=keep), SAVE_TIMEOUT)
    except asyncio.TimeoutError:
        raise LocalmError(504, "Saving the bug report took too long; it was not reported saved (look in the "
                               "reports folder before writing it again)", code="save_timeout") from None
    except OSError as exc:
        log.error("bug report: could not be saved: %s", exc)
        reason = f" ({exc.strerror})" if exc.strerror else ""
        raise LocalmError(500, f"The bug report could not be saved{reason}; nothing was saved",
                          code="report_not_saved") from None
    out: dict[str, Any] = {"saved": True, "filename": path.name, "path": bugreport.public_path(k, path, caller),
                           "maintainer": _maintainer(k)}
    try:
        data = await asyncio.to_thread(bugreport.read, k.data_dir, path.name)
    except LocalmError:
        return out  # saved, but not readable back: no text to review
    out["report_markdown"] = data.decode("utf-8", errors="replace")
    out["report_sha256"] = bugreport.digest(data)
    return out


@post("/api/bug-report/send", scope="config:write",
      summary="File a saved, reviewed bug report through the bug-report proxy",
      body={"type": "object", "title": "BugReportSend", "required": ["filename", "sha256"],
            "additionalProperties": False,
            "properties": {"filename": {"type": "string", "pattern": f"^{bugreport.NAME.pattern}$"},
                           "sha256": {"type": "string", "pattern": "^[0-9a-fA-F]{64}$",
                                      "description": "report_sha256, as POST /api/bug-report returned it"}}},
      errors={400: "No sha256, a filename that is not a saved report's bare name, or an unknown field",
              404: "The saved report cannot be read",
              409: "The report's text no longer has this digest: nothing was sent"})
async def send_bug_report(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    body = await json_body(request)
    unknown = sorted(set(body) - {"filename", "sha256"})
    if unknown:
        raise LocalmError(400, f"Unknown field(s): {', '.join(unknown)} (filename and sha256 are read)")
    sha = body.get("sha256")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise LocalmError(400, "sha256 is required: the report_sha256 POST /api/bug-report returned for this report",
                          code="missing_digest")
    name = bugreport.check_name(body.get("filename"))
    data = await asyncio.to_thread(bugreport.read, k.data_dir, name)
    if not hmac.compare_digest(bugreport.digest(data), sha.lower()):
        raise LocalmError(409, f"{name} has changed since it was shown (its digest differs); nothing was sent. "
                               "Review it again, or write a new report", code="report_changed")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise LocalmError(404, f"No saved report {name} can be read (it is not UTF-8 text)",
                          code="report_not_found") from None
    out: dict[str, Any] = {"filename": name, "maintainer": _maintainer(k)}
    ep = bugproxy.endpoint(k.config)
    if ep is None:
        return {**out, "uploaded": False, "upload_stage": "configure",
                "upload_message": "No bug-report proxy is configured (the owner sets bugreport_upload_url); "
                                  "the report stays saved",
                "upload_error": "not_configured"}
    decision = netpolicy.outbound(k.config, PROXY)
    if not decision.allowed:
        return {**out, "uploaded": False, "upload_stage": "net_mode", "upload_message": decision.error,
                "upload_error": f"net_mode is {decision.mode}"}
    title, report = bugreport.for_filing(text)
    try:
        url = await bugproxy.file_issue(ep, title, report)
    except bugproxy.ProxyError as exc:
        out.update({"uploaded": False, "upload_stage": exc.stage, "upload_message": exc.message,
                    "upload_error": f"HTTP {exc.status}" if exc.status is not None else exc.stage})
        if exc.retry_after is not None:
            out.update({"rate_limited": True, "retry_after": exc.retry_after})
        return out
    log.info("bug report %s filed", name)
    out["uploaded"] = True
    if url:
        out["issue_url"] = url
    return out


ROUTES = [read_changelog, list_issues, create_bug_report, send_bug_report]
