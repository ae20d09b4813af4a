"""Named API keys: who a caller is, which collections it may read, and how much it may ask.

`ragkv serve --api-keys FILE` reads a JSON list of keys:

    [{"name": "agents-prod", "key_sha256": "9f86d0...", "collections": ["docs"],
      "requests_per_minute": 600, "prompt_tokens_per_minute": 2000000},
     {"name": "ci", "key": "a-long-random-secret"}]

`key` (the secret itself) or `key_sha256` (its hex SHA-256, so the file need not hold the
secret); `collections` absent = every collection; each limit absent = none. The single
bearer token (`--auth-token-file`, $RAGKV_AUTH_TOKEN) is one unnamed key with no limits.

A presented key is hashed and looked up by digest, then compared in constant time; the
caller it names (`Caller`) rides with the request: its name is the KV tree's tenant (one
key's conversations never serve another's), a metrics label and a log field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ragkv.errors import RagKVError
from ragkv.server.query import Query
from ragkv.types import SALT_SEP

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FIELDS = frozenset({"name", "key", "key_sha256", "collections", "requests_per_minute", "prompt_tokens_per_minute"})
TOKEN_KEY_NAME = "token"  # the name the single bearer token's key carries in logs and metrics
TOKEN_ENV = "RAGKV_AUTH_TOKEN"
WINDOW_S = 60.0  # seconds: the limits are per minute, over a sliding window


class UnauthenticatedError(RagKVError):
    """No credentials, or credentials no key matches (UNAUTHENTICATED / 401)."""


class PermissionDeniedError(RagKVError):
    """The caller's key does not grant what it asked for (PERMISSION_DENIED / 403)."""


class RateLimitedError(RagKVError):
    """The caller's key is past one of its per-minute limits (RESOURCE_EXHAUSTED / 429)."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request, once its key is checked."""

    name: str  # the key's name ("" = no authentication configured: the server is open)
    collections: frozenset[str] | None = None  # what it may read; None = every collection
    requests_per_minute: int | None = None  # None = no limit
    prompt_tokens_per_minute: int | None = None  # None = no limit

    def may_read(self, collection: str) -> bool:
        return self.collections is None or collection in self.collections

    def check_collection(self, collection: str) -> None:
        """Raises PermissionDeniedError when this key may not read `collection` (the message names
        neither the key's collections nor any other)."""
        if not self.may_read(collection):
            raise PermissionDeniedError(f"this API key may not read collection {collection!r}")

    @property
    def label(self) -> str:
        """Its name as a metrics label and log field ("-" when the server is open)."""
        return self.name or "-"

    def tenant(self, cache_salt: str | None = None) -> str:
        """Whose KV-tree paths a request reads and writes: the key, and the request's own
        `cache_salt` within it (vLLM's name) when it gives one."""
        return self.name if not cache_salt else f"{self.name}{SALT_SEP}{cache_salt}"


ANONYMOUS = Caller("")  # every caller of a server with no credentials configured


def _positive(entry: Mapping[str, object], field: str, where: str) -> int | None:
    value = entry.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {field} must be a positive integer, got {value!r}")
    return value


def _digest(entry: Mapping[str, object], where: str) -> bytes:
    key, hashed = entry.get("key"), entry.get("key_sha256")
    if (key is None) == (hashed is None):
        raise ValueError(f"{where}: give exactly one of 'key' (the secret) or 'key_sha256' (its hex SHA-256)")
    if key is not None:
        if not isinstance(key, str) or len(key) < 16:
            raise ValueError(f"{where}: 'key' must be a string of at least 16 characters (use a random secret, "
                             f"e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
        return hashlib.sha256(key.encode()).digest()
    if not isinstance(hashed, str) or not _HEX64.fullmatch(hashed.lower()):
        raise ValueError(f"{where}: 'key_sha256' must be 64 hex digits, got {hashed!r}")
    return bytes.fromhex(hashed)


class KeyRing:
    """The keys a server accepts; empty = no authentication (every caller is `ANONYMOUS`).

    Args:
        keys: (SHA-256 digest of the secret, the caller it names) pairs.
    """

    def __init__(self, keys: Iterable[tuple[bytes, Caller]] = ()) -> None:
        self._by_digest: dict[bytes, Caller] = {}
        for digest, caller in keys:
            if digest in self._by_digest:
                raise ValueError(f"API keys {self._by_digest[digest].name!r} and {caller.name!r} have the same secret")
            self._by_digest[digest] = caller
        names = [c.name for c in self._by_digest.values()]
        if len(set(names)) != len(names):
            raise ValueError(f"API key names must be unique, got {sorted(names)}")
        self._usage = _Usage()

    @property
    def enabled(self) -> bool:
        """Whether callers must present a key."""
        return bool(self._by_digest)

    def items(self) -> list[tuple[bytes, Caller]]:
        """(digest, caller) of every key."""
        return list(self._by_digest.items())

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self._by_digest.values())

    @classmethod
    def from_token(cls, token: str) -> KeyRing:
        """The single shared bearer token as one unnamed key (every collection, no limits)."""
        if not token:
            raise ValueError("token must be non-empty")
        return cls([(hashlib.sha256(token.encode()).digest(), Caller(TOKEN_KEY_NAME))])

    @classmethod
    def parse(cls, data: object, where: str = "API keys") -> KeyRing:
        """Read the `--api-keys` JSON (a list of key objects); ValueError names the bad entry and field."""
        if not isinstance(data, list) or not data:
            raise ValueError(f"{where}: must be a non-empty JSON list of keys, e.g. "
                             f'[{{"name": "agents", "key_sha256": "<64 hex>", "collections": ["docs"]}}]')
        keys = []
        for i, entry in enumerate(data):
            at = f"{where}[{i}]"
            if not isinstance(entry, dict):
                raise ValueError(f"{at}: must be an object, got {entry!r}")
            unknown = sorted(set(entry) - _FIELDS)
            if unknown:
                raise ValueError(f"{at}: unknown fields {unknown} (known: {sorted(_FIELDS)})")
            name = entry.get("name")
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ValueError(f"{at}: 'name' must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}")
            collections = entry.get("collections")
            if collections is not None and (not isinstance(collections, list)
                                            or not all(isinstance(c, str) and c for c in collections)):
                raise ValueError(f"{at}: 'collections' must be a list of collection names, got {collections!r}")
            caller = Caller(name, None if collections is None else frozenset(collections),
                            _positive(entry, "requests_per_minute", at), _positive(entry, "prompt_tokens_per_minute", at))
            keys.append((_digest(entry, at), caller))
        return cls(keys)

    @classmethod
    def load(cls, path: Path) -> KeyRing:
        """Read an `--api-keys` file; ValueError names the file and what is wrong in it."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read the API keys file {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"API keys file {path} is not JSON: {exc}") from None
        return cls.parse(data, where=f"API keys file {path}")

    def authenticate(self, authorization: str | bytes | None) -> Caller:
        """The caller an `authorization` header or metadata value (`Bearer <key>`) names.

        Raises:
            UnauthenticatedError: keys are configured and the value is missing or names none.
        """
        if not self._by_digest:
            return ANONYMOUS
        if authorization is None:
            raise UnauthenticatedError("missing 'authorization: Bearer <key>' credentials")
        raw = authorization.encode() if isinstance(authorization, str) else bytes(authorization)
        scheme, _, secret = raw.partition(b" ")
        if scheme.lower() != b"bearer" or not secret.strip():
            raise UnauthenticatedError("credentials must be 'authorization: Bearer <key>'")
        digest = hashlib.sha256(secret.strip()).digest()
        # looked up by the secret's digest: how long a lookup takes says nothing of the secret
        caller = self._by_digest.get(digest)
        if caller is None:
            raise UnauthenticatedError("invalid API key")
        return caller

    def authenticate_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Caller:
        """`authenticate` on a gRPC call's invocation metadata."""
        got = None
        for name, value in metadata or ():
            if name == "authorization":
                got = value
        return self.authenticate(got)

    def admit(self, caller: Caller, query: Query, cache_salt: str | None = None) -> Query:
        """`admit_query` for a validated query, returned with its tenant (`Caller.tenant`: the
        key, and the request's `cache_salt` within it)."""
        self.admit_query(caller, query.collection)
        return dataclasses.replace(query, tenant=caller.tenant(cache_salt))

    def admit_query(self, caller: Caller, collection: str) -> None:
        """A request of `caller` reading `collection`: PermissionDeniedError when its key may not read
        it, RateLimitedError when the key is past a per-minute limit; else it counts against them."""
        caller.check_collection(collection)
        self._usage.admit(caller)

    def charge_tokens(self, caller: Caller, prompt_tokens: int) -> None:
        """Count an answered request's prompt tokens against `caller`'s per-minute limit."""
        self._usage.charge(caller, prompt_tokens)

    def bill(self, caller: Caller) -> PromptBill:
        """A request's prompt tokens against `caller`'s per-minute limit, reserved before they are computed."""
        return PromptBill(self._usage, caller)


@dataclass(slots=True)
class PromptBill:
    """One request's prompt tokens against its key's per-minute limit (`prompt_tokens_per_minute`).

    `reserve` counts them the moment the prompt is known (after retrieval, before any of it is
    computed), refusing the request when the key is already at its limit; so concurrent requests
    see each other's tokens, and one cancelled or past its deadline after its prefill is charged
    all the same. `settle` at the end charges what the answer counted beyond the reservation.
    """

    _usage: _Usage
    caller: Caller
    reserved: int = 0

    def reserve(self, prompt_tokens: int) -> None:
        """Raises RateLimitedError (nothing reserved) when the key has used its minute's tokens."""
        self._usage.reserve(self.caller, prompt_tokens)
        self.reserved += prompt_tokens

    def settle(self, prompt_tokens: int) -> int:
        """Charge what `prompt_tokens` is past the reservation; returns it (0 when within)."""
        extra = max(0, prompt_tokens - self.reserved)
        self._usage.charge(self.caller, extra)
        self.reserved += extra
        return extra


class _Usage:
    """Per-key sliding one-minute windows of requests and prompt tokens."""

    def __init__(self, clock=time.monotonic) -> None:  # a seconds clock
        self._clock = clock
        self._lock = threading.Lock()
        self._requests: dict[str, deque[float]] = {}
        self._tokens: dict[str, deque[tuple[float, int]]] = {}

    def _check_tokens(self, caller: Caller, now: float) -> deque[tuple[float, int]]:
        """The key's tokens of the last minute (under the lock); RateLimitedError when they are at its limit."""
        tokens = self._tokens.setdefault(caller.name, deque())
        while tokens and tokens[0][0] <= now - WINDOW_S:
            tokens.popleft()
        used = sum(n for _, n in tokens)
        if caller.prompt_tokens_per_minute is not None and used >= caller.prompt_tokens_per_minute:
            wait = tokens[0][0] + WINDOW_S - now
            raise RateLimitedError(f"API key {caller.name!r} used {used} prompt tokens in the last minute, its "
                                   f"limit is {caller.prompt_tokens_per_minute}; retry in {wait:.0f} s")
        return tokens

    def reserve(self, caller: Caller, prompt_tokens: int) -> None:
        if caller.prompt_tokens_per_minute is None or prompt_tokens <= 0:
            return
        now = self._clock()
        with self._lock:
            self._check_tokens(caller, now).append((now, prompt_tokens))

    def admit(self, caller: Caller) -> None:
        if caller.requests_per_minute is None and caller.prompt_tokens_per_minute is None:
            return
        now = self._clock()
        with self._lock:
            self._check_tokens(caller, now)
            times = self._requests.setdefault(caller.name, deque())
            while times and times[0] <= now - WINDOW_S:
                times.popleft()
            if caller.requests_per_minute is not None and len(times) >= caller.requests_per_minute:
                wait = times[0] + WINDOW_S - now
                raise RateLimitedError(f"API key {caller.name!r} sent {len(times)} requests in the last minute, its "
                                       f"limit is {caller.requests_per_minute}; retry in {wait:.0f} s")
            times.append(now)

    def charge(self, caller: Caller, prompt_tokens: int) -> None:
        if caller.prompt_tokens_per_minute is None or prompt_tokens <= 0:
            return
        with self._lock:
            self._tokens.setdefault(caller.name, deque()).append((self._clock(), prompt_tokens))


def load_key_ring(api_keys_file: Path | None, token: str | None) -> KeyRing:
    """The server's keys: the `--api-keys` file's, plus the single bearer token as one more key."""
    ring = KeyRing.load(api_keys_file) if api_keys_file is not None else KeyRing()
    if token is None:
        return ring
    return KeyRing([*ring.items(), *KeyRing.from_token(token).items()])


def read_token(token_file: Path | None, env: dict[str, str] | None = None) -> str | None:
    """The server token: from token_file if given, else $RAGKV_AUTH_TOKEN, else None.

    Raises:
        ValueError: token_file is empty.
    """
    if token_file is not None:
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"auth token file {token_file} is empty")
        return token
    token = (os.environ if env is None else env).get(TOKEN_ENV, "").strip()
    return token or None


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a port on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_exposure(host: str, keys: KeyRing, insecure_no_auth: bool) -> None:
    """Fail closed: refuse to serve on a non-loopback `host` with no credentials, unless told to.

    Raises:
        ValueError: naming the flags that give credentials and the opt-out.
    """
    if keys.enabled or is_loopback(host):
        return
    if not insecure_no_auth:
        raise ValueError(
            f"refusing to serve on {host} with no credentials: anyone who can reach the port could read every "
            f"collection. Pass --api-keys FILE (named keys, docs/security.md) or --auth-token-file FILE (or "
            f"set {TOKEN_ENV}); bind --host 127.0.0.1 to serve this machine only; or pass --insecure-no-auth "
            f"to serve openly on a network you trust")
    log.warning("serving on %s with NO authentication (--insecure-no-auth): anyone who can reach the port "
                "can read every collection", host)
