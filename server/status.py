"""Server-side errors and the one mapping from exceptions to gRPC status codes.

`ragkv.errors` is the project's exception tree; the classes here are the ones only
the serving path raises. `status_for` is the only place a Python exception becomes
a status code.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from ragkv.convert import WireValueError
from ragkv.engine.scheduler import SchedulerFullError, SchedulerStoppedError
from ragkv.errors import (
    IndexMismatchError,
    KVFormatError,
    ModelLoadError,
    RagKVError,
    StoreError,
    UnsupportedModelError,
)
from ragkv.server.api_keys import PermissionDeniedError, RateLimitedError, UnauthenticatedError


class InvalidArgumentError(RagKVError, ValueError):
    """A request field holds a bad value.

    Attributes:
        field: The request field, named as in the .proto.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class UnknownCollectionError(RagKVError, LookupError):
    """A request names a collection this server does not serve."""

    @classmethod
    def naming(cls, name: str, served: Iterable[str]) -> UnknownCollectionError:
        """The error for `name`, listing what is served."""
        return cls(f"collection {name!r} is not served here (served: {', '.join(sorted(served))})")


class OverloadedError(RagKVError):
    """The request queue is full."""


class RequestTooLargeError(RagKVError):
    """A request body is over the server's size cap (HTTP 413; gRPC refuses it itself as
    RESOURCE_EXHAUSTED)."""


class NotServingError(RagKVError):
    """The server is still loading, or draining before it stops."""


class ReplicaLostError(RagKVError):
    """The cluster replica answering a request stopped after its answer began (UNAVAILABLE:
    ask again; a request that had not begun is retried on another replica)."""


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (RateLimitedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (WireValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownCollectionError, grpc.StatusCode.NOT_FOUND),
    (IndexMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (UnsupportedModelError, grpc.StatusCode.FAILED_PRECONDITION),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SchedulerFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SchedulerStoppedError, grpc.StatusCode.UNAVAILABLE),
    (NotServingError, grpc.StatusCode.UNAVAILABLE),
    (ReplicaLostError, grpc.StatusCode.UNAVAILABLE),
    (StoreError, grpc.StatusCode.UNAVAILABLE),
    (KVFormatError, grpc.StatusCode.DATA_LOSS),
    (ModelLoadError, grpc.StatusCode.INTERNAL),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and client-facing message for an exception.

    Expected errors keep their message (it names the bad value); anything else is
    INTERNAL with a generic message, since its text may leak server internals.
    """
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while loading KV"
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"
