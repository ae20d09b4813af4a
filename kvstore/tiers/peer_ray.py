"""The peer tier on Ray: its directory is one named actor, its bytes live in Ray's object store.

Ray moves an object between nodes by itself (shared memory on one node, its object manager
across nodes), and an object belongs to the replica that put it: when that replica dies its
objects are lost, and a read of one raises, which `RayObjects` turns into `PeerReadError` (a
miss). Only the cluster (`server/cluster.py`, the `ray` extra) imports this module.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError

from ragkv.kvstore.tiers.peer import DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S, PeerCopy, PeerDirectory, PeerReadError

logger = logging.getLogger(__name__)

DIRECTORY_NAME = "ragkv-peer-directory"
NAMESPACE = "ragkv"


def directory_actor(ttl_s: float = DEFAULT_TTL_S, max_entries: int = DEFAULT_MAX_ENTRIES) -> Any:
    """The cluster's directory actor: the running one, or a new one (it takes no CPU)."""
    cls = ray.remote(num_cpus=0, max_restarts=-1)(PeerDirectory)
    return cls.options(name=DIRECTORY_NAME, namespace=NAMESPACE, get_if_exists=True,
                       lifetime="detached").remote(ttl_s, max_entries)


def find_directory() -> Any | None:
    """The cluster's directory actor, or None when none runs (the peer tier is off)."""
    try:
        return ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def kill_directory() -> None:
    """Stop the directory actor (`ragkv serve` shutting down); a no-op when none runs."""
    actor = find_directory()
    if actor is not None:
        ray.kill(actor)


class RayDirectory:
    """`kvstore.tiers.peer.Directory` over the directory actor: events are sent without waiting,
    lookups wait at most `timeout_s`."""

    def __init__(self, actor: Any, timeout_s: float) -> None:
        self.actor, self.timeout_s = actor, timeout_s
        self._last: Any = None  # the last event sent: the actor runs one caller's calls in order

    def publish(self, key: str, replica: str, handle: object, nbytes: int) -> None:
        self._send("publish", key, replica, handle, nbytes)

    def publish_many(self, replica: str, copies: list[tuple[str, object, int]]) -> None:
        self._send("publish_many", replica, copies)  # (the handles, lists inside a list, stay references)

    def withdraw(self, replica: str, keys: list[str]) -> None:
        self._send("withdraw", replica, keys)

    def lost(self, key: str, replica: str) -> None:
        self._send("lost", key, replica)

    def forget(self, replica: str) -> None:
        self._send("forget", replica)

    def lookup(self, key: str) -> list[PeerCopy]:
        return self.lookup_many([key])[0]

    def lookup_many(self, keys: list[str]) -> list[list[PeerCopy]]:
        try:
            return ray.get(self.actor.lookup_many.remote(keys), timeout=self.timeout_s)  # type: ignore[no-any-return]
        except (GetTimeoutError, RayError) as e:
            raise PeerReadError(f"the peer directory did not answer within {self.timeout_s}s: {e}") from e

    def stats(self) -> dict[str, int]:
        try:
            return ray.get(self.actor.stats.remote(), timeout=self.timeout_s)  # type: ignore[no-any-return]
        except (GetTimeoutError, RayError) as e:
            raise PeerReadError(f"the peer directory did not answer within {self.timeout_s}s: {e}") from e

    def settled(self, timeout_s: float) -> bool:
        """Whether the events sent so far have run on the directory (waiting up to `timeout_s`)."""
        last = self._last
        if last is None:
            return True
        ready, _ = ray.wait([last], timeout=timeout_s)
        return bool(ready)

    def _send(self, method: str, *args: object) -> None:
        try:
            self._last = getattr(self.actor, method).remote(*args)
        except RayError as e:  # the directory is restarting: the event is lost, its TTL cleans up
            logger.warning("peer directory %s failed: %s", method, e)


class RayObjects:
    """`kvstore.tiers.peer.ObjectStore` over Ray's object store."""

    def put(self, data: bytes) -> object:
        # as a uint8 array: Ray reads it back as a view of the object store's shared memory
        # (`view`), where bytes come back copied. Boxed: an ObjectRef at the top level of an actor
        # call's arguments would be resolved to its bytes; inside a list the directory holds it.
        return [ray.put(np.frombuffer(data, dtype=np.uint8))]

    def view(self, handle: object) -> memoryview | None:
        """The object's bytes in the object store's shared memory, read-only, with no copy (an
        object of this node; None if it cannot be read at once)."""
        try:
            data = self.get(handle, 1.0)
        except PeerReadError:
            return None
        return data if isinstance(data, memoryview) else None

    def get(self, handle: object, timeout_s: float) -> bytes | memoryview:
        if not isinstance(handle, list) or len(handle) != 1:
            raise PeerReadError(f"not a peer tier handle: {handle!r}")
        try:
            data = ray.get(handle[0], timeout=timeout_s)
        except (GetTimeoutError, RayError) as e:  # lost with its owner, or past the deadline
            raise PeerReadError(f"{type(e).__name__}: {e}") from e
        if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1:
            return memoryview(data)  # read-only: the object store's memory
        if not isinstance(data, bytes | memoryview):
            raise PeerReadError(f"a peer object held {type(data).__name__}, not bytes")
        return data
