"""Stored responses of the Responses API (`/v1/responses` with `store`, `previous_response_id`).

Kept in memory, by id: least recently used dropped first, bounded in count and bytes, and
in age (a response older than `max_age_s`, counted from when it was stored, is not found
and is deleted). Each belongs to the tenant that made it (`Caller.tenant`: the API key's
name and its cache salt): another tenant finds nothing under its id, exactly as under an
unknown one.

With a directory (`ragkv serve --responses-dir`) every stored response is also one file
there, `<id>.json`, so a restarted server finds it again. A file is written whole to a
temporary name and renamed over (`os.replace`): a crash mid-write leaves at most a stray
temporary file (removed at the next start), never a torn response, and never touches
another response's file. At start the directory is read back, oldest first, under the same
bounds; a file that does not read as a stored response is skipped with a warning (and left
for whoever wants to look at it). One server per directory: two would drop each other's
files as they evict.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ragkv.atomic import private_dir, write_bytes
from ragkv.errors import RagKVError
from ragkv.types import SALT_SEP

if TYPE_CHECKING:
    from ragkv.server.settings import ServerSettings

log = logging.getLogger(__name__)

MAX_RESPONSES = 10_000
MAX_ENTRY_BYTES = 2 * 1024**2  # one stored response: its whole conversation and its response object
MAX_STORE_BYTES = 256 * 1024**2
MAX_AGE_S = 30 * 86400.0  # seconds: OpenAI keeps stored responses 30 days by default

FORMAT = 1  # the files' layout version
_SUFFIX, _TEMP = ".json", ".tmp"
_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # ids that may name a file


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
    created_at: float = 0.0  # the store's clock (Unix seconds) when it was stored: its age counts from here


class ResponseStore:
    """Stored responses by id: least recently used dropped first, bounded in count, bytes and
    age; kept in `directory` too when one is given (see the module docstring).

    A response larger than `max_entry_bytes` is not kept. Thread-safe.

    Args:
        max_entries: Stored responses at most.
        max_entry_bytes: Bytes of one response's conversation and response object, as JSON.
        max_bytes: Bytes of all of them.
        max_age_s: Seconds a response is found after it was stored.
        key_share: While other keys hold responses here, a key past this share of `max_entries`
            or `max_bytes` makes room from its own least recently used (a tenant's key is its part
            before `SALT_SEP`): one key's `store=true` flood cannot drop every other key's.
        directory: Where each response is a file; None = memory only (lost on restart).
        clock: Unix seconds now (tests pass their own).

    Raises:
        ValueError: A bound is not positive, or `directory` is not a directory.
    """

    def __init__(self, max_entries: int = MAX_RESPONSES, max_entry_bytes: int = MAX_ENTRY_BYTES,
                 max_bytes: int = MAX_STORE_BYTES, max_age_s: float = MAX_AGE_S, directory: Path | None = None,
                 clock: Callable[[], float] = time.time, key_share: float = 0.5) -> None:
        if min(max_entries, max_entry_bytes, max_bytes) < 1 or not 0 < max_age_s < math.inf:
            raise ValueError(f"max_entries, max_entry_bytes, max_bytes and max_age_s must be > 0 (and max_age_s "
                             f"finite), got {max_entries}, {max_entry_bytes}, {max_bytes}, {max_age_s}")
        if not 0 < key_share <= 1:
            raise ValueError(f"key_share must be in (0, 1], got {key_share}")
        self.key_share = key_share
        self._held: dict[str, list[int]] = {}  # key -> [responses, bytes] it holds
        self.max_entries, self.max_entry_bytes, self.max_bytes = max_entries, max_entry_bytes, max_bytes
        self.max_age_s = max_age_s
        self.directory = None if directory is None else Path(directory)
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._stored: OrderedDict[str, float] = OrderedDict()  # id -> created_at, oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        if self.directory is not None:
            self._load(self.directory)

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> ResponseStore:
        """The store `ragkv serve --responses-*` describes."""
        return cls(max_entries=settings.responses_max_count, max_bytes=settings.responses_max_bytes,
                   max_age_s=settings.responses_max_age_s, directory=settings.responses_dir,
                   key_share=settings.responses_key_share)

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def size_of(*values: object) -> int:
        return sum(len(json.dumps(v, default=str)) for v in values)

    def put(self, response_id: str, tenant: str, items: tuple[dict[str, Any], ...], response: dict[str, Any]) -> bool:
        """Keep a response (in its file first, when the store has a directory); False when it is
        larger than one entry may be.

        Raises:
            ValueError: The store has a directory and `response_id` cannot name a file.
            OSError: Its file could not be written (the response is not kept).
        """
        size = self.size_of(list(items), response)
        if size > self.max_entry_bytes:
            return False
        entry = StoredResponse(tenant, items, response, size, self._clock())
        if self.directory is not None:
            if not _SAFE_ID.fullmatch(response_id):
                raise ValueError(f"response id {response_id!r} cannot name a file: letters, digits, _ and - only")
            self._write(response_id, entry)
        with self._lock:
            self._insert(response_id, entry)
            dropped = self._expired() + self._over_bounds(_key(tenant))
        self._unlink(dropped)
        return True

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The response, if `tenant` stored it (another tenant's is None, as an unknown id's,
        and so is one past `max_age_s`)."""
        with self._lock:
            dropped = self._expired()
            entry = self._entries.get(response_id)
            if entry is not None and entry.tenant == tenant:
                self._entries.move_to_end(response_id)
            else:
                entry = None
        self._unlink(dropped)
        return entry

    def delete(self, response_id: str, tenant: str) -> bool:
        """Forget a response of `tenant`'s (its file too); False when it has none by this id."""
        with self._lock:
            dropped = self._expired()
            entry = self._entries.get(response_id)
            found = entry is not None and entry.tenant == tenant
            if found:
                self._remove(response_id)
                dropped.append(response_id)
        self._unlink(dropped)
        return found

    # ---- memory (under the lock) ----

    def _insert(self, response_id: str, entry: StoredResponse) -> None:
        if response_id in self._entries:
            self._remove(response_id)
        self._entries[response_id] = entry
        self._stored[response_id] = entry.created_at
        self._bytes += entry.size
        held = self._held.setdefault(_key(entry.tenant), [0, 0])
        held[0], held[1] = held[0] + 1, held[1] + entry.size

    def _remove(self, response_id: str) -> None:
        entry = self._entries.pop(response_id)
        del self._stored[response_id]
        self._bytes -= entry.size
        key = _key(entry.tenant)
        held = self._held[key]
        held[0], held[1] = held[0] - 1, held[1] - entry.size
        if not held[0]:
            del self._held[key]

    def _expired(self) -> list[str]:
        """Drop the responses past their age (oldest first: they lead `_stored`); their ids."""
        oldest = self._clock() - self.max_age_s
        out = []
        while self._stored:
            response_id, created = next(iter(self._stored.items()))
            if created >= oldest:
                break
            self._remove(response_id)
            out.append(response_id)
        return out

    def _over_bounds(self, key: str | None = None) -> list[str]:
        """Drop least recently used responses until the count and bytes are within bounds; their ids.
        The room for `key`'s new response comes from its own while it is past its share and
        other keys hold responses (`key_share`)."""
        out = []
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            response_id = next(iter(self._entries))
            held = self._held.get(key or "", [0, 0])
            if key is not None and len(self._held) > 1 and (held[0] > self.key_share * self.max_entries
                                                            or held[1] > self.key_share * self.max_bytes):
                response_id = next(i for i, e in self._entries.items() if _key(e.tenant) == key)
            self._remove(response_id)
            out.append(response_id)
        return out

    # ---- files (outside the lock) ----

    def _path(self, response_id: str) -> Path:
        if self.directory is None:
            raise RuntimeError("a file path asked of a memory-only response store: a bug")
        return self.directory / f"{response_id}{_SUFFIX}"

    def _write(self, response_id: str, entry: StoredResponse) -> None:
        """The response's file, whole or not at all (`ragkv.atomic`), readable by the server alone."""
        path = self._path(response_id)
        record = {"format": FORMAT, "id": response_id, "tenant": entry.tenant, "created_at": entry.created_at,
                  "items": list(entry.items), "response": entry.response}
        write_bytes(path, json.dumps(record, default=str).encode(), mode=0o600)

    def _unlink(self, response_ids: list[str]) -> None:
        if self.directory is None:
            return
        for response_id in response_ids:
            try:
                self._path(response_id).unlink(missing_ok=True)
            except OSError as exc:  # the entry is gone from memory: a restart may find it, then drop it by age
                log.warning("stored response %s: could not delete its file (%s)", response_id, exc)

    def _load(self, directory: Path) -> None:
        """Read the directory's responses back, oldest first, within the bounds."""
        private_dir(directory, "--responses-dir")  # 0700: stored conversations are the tenants' own
        found: list[tuple[str, StoredResponse]] = []
        for path in sorted(directory.iterdir()):
            if path.name.startswith(".") and path.name.endswith(_TEMP):
                path.unlink(missing_ok=True)  # a write a crash cut short: never renamed, never a response
            elif path.suffix == _SUFFIX and (read := _read(path)) is not None:
                found.append(read)
        found.sort(key=lambda f: f[1].created_at)
        with self._lock:
            for response_id, entry in found:
                self._insert(response_id, entry)
            dropped = self._expired() + self._over_bounds()
        self._unlink(dropped)
        if found:
            log.info("stored responses: %d read back from %s (%d past their age or the bounds, deleted)",
                     len(self._entries), directory, len(dropped))


def _read(path: Path) -> tuple[str, StoredResponse] | None:
    """One response's file, or None (with a warning naming what is wrong) when it is not one."""
    response_id = path.stem
    try:
        record = json.loads(path.read_bytes())
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise ValueError(f"not a stored response of format {FORMAT}")
        if record.get("id") != response_id or not _SAFE_ID.fullmatch(response_id):
            raise ValueError(f"it holds id {record.get('id')!r}, not its file name's")
        tenant, created, items, response = (record.get(k) for k in ("tenant", "created_at", "items", "response"))
        if not isinstance(tenant, str) or not isinstance(created, (int, float)) or not isinstance(items, list) \
                or not all(isinstance(i, dict) for i in items) or not isinstance(response, dict):
            raise ValueError("its tenant, created_at, items or response is missing or of the wrong type")
    except (OSError, ValueError) as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        log.warning("stored response file %s skipped: %s (delete it, or move it away)", path, exc)
        return None
    items_t = tuple(items)
    return response_id, StoredResponse(tenant, items_t, response, ResponseStore.size_of(items, response),
                                       float(created))


def _key(tenant: str) -> str:
    """The API key a tenant belongs to (its cache salt left out): what a share counts."""
    return tenant.partition(SALT_SEP)[0]
