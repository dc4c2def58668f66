"""The in-memory store behind previous_response_id.

A stored response is the whole conversation it ended (the messages of every earlier
response in its chain, its own input and its reply, as chat messages; never the
instructions), kept under the identity of the caller that created it. Nothing is written
to disk: a restart forgets everything.

Bounds: at most ``max_responses`` responses and ``max_bytes`` bytes of conversation JSON.
Past either bound, the oldest response of the identity holding the most (responses when
the count is over, bytes when the size is over) is dropped, so one caller filling the
store evicts its own responses first. A response expires ``ttl`` seconds after it is
stored; :meth:`Store.purge` (run at every request to the route) removes expired ones, and
an expired one is never returned. A conversation larger than ``max_bytes`` on its own is
not kept.

Plain Python with no imports from localm, so a test can load this file on its own.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 256
MAX_BYTES = 64 * 1024 * 1024
TTL_SECONDS = 3600.0


@dataclass(frozen=True)
class Stored:
    id: str
    owner: str  # the identity that created it
    stored_at: float  # clock time
    messages: list[dict[str, Any]]  # the conversation, as chat messages
    size: int  # bytes of the conversation's JSON


class Store:
    """Responses by id, oldest first; see the module docstring."""

    def __init__(self, *, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES,
                 ttl: float = TTL_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self._items: OrderedDict[str, Stored] = OrderedDict()  # insertion order: oldest first
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._items

    @property
    def size(self) -> int:
        """Bytes of conversation JSON held."""
        return self._bytes

    @staticmethod
    def measure(messages: list[dict[str, Any]]) -> int:
        return len(json.dumps(messages, ensure_ascii=False, separators=(",", ":")).encode())

    def put(self, response_id: str, owner: str, messages: list[dict[str, Any]]) -> bool:
        """Keep a conversation; False (nothing kept) when it alone is larger than the store."""
        size = self.measure(messages)
        if size > self.max_bytes or self.max_responses < 1:
            return False
        self.purge()
        self._drop(response_id)
        while len(self._items) + 1 > self.max_responses:
            self._evict(owner, by_bytes=False, extra=size)
        while self._bytes + size > self.max_bytes:
            self._evict(owner, by_bytes=True, extra=size)
        self._items[response_id] = Stored(response_id, owner, self.clock(), messages, size)
        self._bytes += size
        return True

    def get(self, response_id: str, owner: str) -> Stored | None:
        """The response if it exists, has not expired and belongs to ``owner``; else None."""
        item = self._items.get(response_id)
        if item is None or item.owner != owner or self._expired(item):
            return None
        return item

    def purge(self) -> int:
        """Remove expired responses; how many went."""
        gone = [k for k, item in self._items.items() if self._expired(item)]
        for k in gone:
            self._drop(k)
        return len(gone)

    def held(self, owner: str) -> tuple[int, int]:
        """(responses, bytes) an identity holds."""
        items = [item for item in self._items.values() if item.owner == owner]
        return len(items), sum(item.size for item in items)

    # --- inside ---------------------------------------------------------------------

    def _expired(self, item: Stored) -> bool:
        return self.clock() - item.stored_at >= self.ttl

    def _drop(self, response_id: str) -> None:
        item = self._items.pop(response_id, None)
        if item is not None:
            self._bytes -= item.size

    def _evict(self, newcomer: str, *, by_bytes: bool, extra: int) -> None:
        """Drop the oldest response of the identity holding the most; the response about
        to be stored counts for its owner (``newcomer``)."""
        count: dict[str, int] = {}
        size: dict[str, int] = {}
        oldest: dict[str, int] = {}
        for position, item in enumerate(self._items.values()):
            count[item.owner] = count.get(item.owner, 0) + 1
            size[item.owner] = size.get(item.owner, 0) + item.size
            oldest.setdefault(item.owner, position)
        if newcomer in count:
            count[newcomer] += 1
            size[newcomer] += extra
        held = size if by_bytes else count
        # the most held first; on a tie, the identity whose oldest response is older
        owner = min(held, key=lambda o: (-held[o], oldest[o]))
        victim = next(k for k, item in self._items.items() if item.owner == owner)
        self._drop(victim)
