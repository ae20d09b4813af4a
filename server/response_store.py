"""Stored responses of the Responses API (`/v1/responses` with `store`, `previous_response_id`).

Kept in memory, by id: least recently used dropped first, bounded in count and bytes. Each
belongs to the tenant that made it (`Caller.tenant`: the API key's name and its cache salt):
another tenant finds nothing under its id, exactly as under an unknown one.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ragkv.errors import RagKVError

MAX_RESPONSES = 10_000
MAX_ENTRY_BYTES = 2 * 1024**2  # one stored response: its whole conversation and its response object
MAX_STORE_BYTES = 256 * 1024**2


class UnknownResponseError(RagKVError, LookupError):
    """No stored response has this id, for this caller (NOT_FOUND / 404)."""

    def __init__(self, response_id: str, field: str | None) -> None:
        super().__init__(f"Response with id {response_id!r} not found.")
        self.field = field


@dataclass(frozen=True, slots=True)
class StoredResponse:
    tenant: str  # whose it is: only requests of the same tenant find it
    items: tuple[dict[str, Any], ...]  # the whole conversation: input items, then output items
    response: dict[str, Any]  # the response object, as GET returns it
    size: int  # bytes of both, as JSON


class ResponseStore:
    """Stored responses by id: least recently used dropped first, bounded in count and bytes.

    A response larger than `max_entry_bytes` is not kept. Thread-safe.
    """

    def __init__(self, max_entries: int = MAX_RESPONSES, max_entry_bytes: int = MAX_ENTRY_BYTES,
                 max_bytes: int = MAX_STORE_BYTES) -> None:
        self.max_entries, self.max_entry_bytes, self.max_bytes = max_entries, max_entry_bytes, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def size_of(*values: object) -> int:
        return sum(len(json.dumps(v, default=str)) for v in values)

    def put(self, response_id: str, tenant: str, items: tuple[dict[str, Any], ...], response: dict[str, Any]) -> bool:
        """Keep a response; False when it is larger than one entry may be."""
        size = self.size_of(list(items), response)
        if size > self.max_entry_bytes:
            return False
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self._bytes -= old.size
            self._entries[response_id] = StoredResponse(tenant, items, response, size)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.size
        return True

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The response, if `tenant` stored it (another tenant's is None, as an unknown id's)."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.tenant != tenant:
                return None
            self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str, tenant: str) -> bool:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.tenant != tenant:
                return False
            del self._entries[response_id]
            self._bytes -= entry.size
            return True
