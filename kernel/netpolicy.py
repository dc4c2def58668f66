"""May the server make one of its own outbound calls? The ``net_mode`` setting decides.

The server's own outbound calls are the ones it makes to services of the project: the
bug-report proxy (``GET /api/issues``, ``POST /api/bug-report/send``) and the update
channel. ``net_mode`` is ``on`` (allowed), ``ask`` (only when a request asks for the call,
never in the background) or ``off`` (never). A value that is none of these (a hand-edited
config.json) counts as ``off``: the policy fails closed. Model downloads from the Hugging Face
hub follow it too (kernel/hub.py ``downloads_blocked``), unless the owner-only
``net_allow_model_downloads`` lets them through. Upstreams a user configures (the remote
plugin) are governed by their own settings, not by this one.
"""

from __future__ import annotations

from typing import Any

import attrs

MODES = ("on", "ask", "off")
SETTING = "net_mode"


@attrs.frozen
class Decision:
    """The answer for one outbound call: ``allowed``, or ``error``, a sentence for the caller
    that names the setting."""

    allowed: bool
    mode: str
    error: str | None = None


def outbound(config: Any, what: str, *, requested: bool = True) -> Decision:
    """Whether the server may contact ``what`` (words for the error: "the bug-report proxy").

    ``config`` is anything with ``get(key)`` (the kernel's :class:`~localm.kernel.config.Config`);
    ``requested``: the call serves a request a caller made now (False: the server's own
    background work, which ``ask`` refuses)."""
    try:
        mode = config.get(SETTING)
    except Exception:  # an unreadable config: fail closed
        mode = None
    if mode == "on" or (mode == "ask" and requested):
        return Decision(True, mode)
    if mode == "ask":
        return Decision(False, mode, f"{SETTING} is ask: the server contacts {what} only when a request asks it "
                                     f"to, never on its own; set {SETTING} to on to allow it")
    if mode == "off":
        return Decision(False, mode, f"{SETTING} is off: the server makes no outbound call to {what}; "
                                     f"set {SETTING} to on or ask to allow it")
    return Decision(False, "off", f"{SETTING} holds {mode!r}, which is not one of on, ask or off, so the server "
                                  f"makes no outbound call to {what}; set {SETTING} to on, ask or off")
