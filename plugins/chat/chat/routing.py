"""Capability routing: which installed model answers a request that needs what the model it
would otherwise get cannot do (the spec's "Capability-based model routing").

A request is **pinned** when it names a model (``pin_model`` unset) or sends ``pin_model:
true``; it is unpinned when it leaves ``model`` unset, empty or ``"localm"``, or sends
``pin_model: false``. A pinned request is answered by its model whatever it lacks (its gaps are
reported). An unpinned one goes to an installed chat model that has what it needs:

- **must-haves**, which the request cannot be answered without: ``vision`` for an image part,
  ``audio_input`` for an audio part, ``context`` for ``min_context`` (the trained window it
  must hold; a prompt too long for the model's own window is a need found later, while the
  prompt is prepared);
- **wants**: ``tool_use`` for a request with tools, and whatever ``required_capabilities``
  lists.

The first candidate with everything wins (one already loaded first, then by name); failing
that, one with every must-have and the fewest wants missing; failing that, the request stays
with its model. What the model that answers still lacks is ``unmet``.

Capabilities come from the registry entries (what inspecting the files said): a key that is
missing or null is ``unknown``, which counts as a gap and is never chosen for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import attrs

from .request import CAPABILITIES

#: What the request cannot be answered without (the others it only wants).
MUST = ("vision", "audio_input", "context")


@attrs.frozen
class Needs:
    """What a request needs of the model that answers it."""

    capabilities: tuple[str, ...] = ()  # of CAPABILITIES, in that order
    min_context: int | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return self.capabilities + (("context",) if self.min_context else ())

    def __bool__(self) -> bool:
        return bool(self.names)


def needs_of(*, images: bool, audio: bool, tools: bool, required: Iterable[str],
             min_context: int | None) -> Needs:
    wanted = set(required) | ({"vision"} if images else set()) | ({"audio_input"} if audio else set()) \
        | ({"tool_use"} if tools else set())
    return Needs(capabilities=tuple(c for c in CAPABILITIES if c in wanted), min_context=min_context)


def has(entry: Any, name: str, needs: Needs) -> str:
    """"yes", "absent" or "unknown": whether ``entry`` has the capability ``name``."""
    caps = entry.capabilities or {}
    if name == "context":
        window = caps.get("context_window")
        if not isinstance(window, int) or window <= 0:
            return "unknown"
        return "yes" if window >= (needs.min_context or 0) else "absent"
    value = caps.get(name)
    if value is None:
        return "unknown"
    return "yes" if value else "absent"


def gaps(entry: Any, needs: Needs) -> dict[str, str]:
    """Each need ``entry`` does not meet: "absent" or "unknown"."""
    out = {}
    for name in needs.names:
        found = has(entry, name, needs)
        if found != "yes":
            out[name] = found
    return out


def installed(entry: Any) -> bool:
    """A chat model whose files are present (a model a plugin provides has none to check)."""
    if entry.role != "chat":
        return False
    if entry.provider is not None or not entry.path:
        return True
    return Path(entry.path).exists()


@attrs.frozen
class Route:
    """The model that answers, and what to tell the client (None: nothing to explain)."""

    entry: Any
    routed: bool
    header: dict[str, Any] | None = None
    #: the other capable models, in the order to try them when this one fails to load
    fallbacks: tuple[Any, ...] = ()


def choose(default: Any, entries: Iterable[Any], needs: Needs, *, pinned: bool, requested: str | None,
           loaded: Iterable[str] = ()) -> Route:
    """The model that answers a request that would go to ``default``."""
    missing = gaps(default, needs) if needs else {}
    if not missing:
        return Route(default, False)
    asked = requested or "localm"
    if pinned:
        return Route(default, False, _header(default.id, asked, False, True, missing, []))
    resident = set(loaded)
    must = [n for n in needs.names if n in MUST]
    ranked = []
    for entry in entries:
        if entry.id == default.id or not installed(entry):
            continue
        lacks = gaps(entry, needs)
        if any(n in lacks for n in must):
            continue
        ranked.append((len(lacks), entry.id not in resident, entry.id, entry))
    ranked.sort(key=lambda item: item[:3])
    # a model that lacks as much as the default, and no must-have it has, is no better
    better = [item for item in ranked if item[0] < len(missing) or any(n in missing for n in must)]
    if not better:
        return Route(default, False, _header(default.id, asked, False, False, missing, list(missing)))
    best = better[0][3]
    unmet = list(gaps(best, needs))
    return Route(best, True, _header(best.id, asked, True, False, missing, unmet),
                 fallbacks=tuple(item[3] for item in better[1:]))


def _header(resolved: str, requested: str, routed: bool, pinned: bool, missing: dict[str, str],
            unmet: list[str]) -> dict[str, Any]:
    return {"resolved": resolved, "requested": requested, "routed": routed, "pinned": pinned, "gaps": missing,
            "unmet": unmet}


def header_value(header: dict[str, Any]) -> str:
    """X-Localm-Model-Routing's value: compact JSON."""
    return json.dumps(header, separators=(",", ":"))
