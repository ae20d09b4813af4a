"""gRPC channels for the SDK: plaintext or TLS, and the bearer-token call metadata.

The token travels as `authorization: Bearer <token>` metadata on every call (it is
not a channel credential). Over plaintext it goes only to this machine (a loopback
address, localhost, a unix socket): to any other host it needs TLS, or `insecure=True`
on a network you trust (then it warns).
"""

from __future__ import annotations

import ipaddress
import warnings
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

# Answers carry whole chunk texts; allow messages well above gRPC's 4 MiB default.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def _loopback(target: str) -> bool:
    """Whether `target` ("host:port", "[v6]:port", "unix:...") stays on this machine."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    host = target.rpartition(":")[0].strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    """Where and how a client connects."""

    target: str  # "host:port"
    token: str | None = None  # bearer token; None = no auth header
    tls: bool = False  # TLS with root_certificates (or the system roots)
    root_certificates: bytes | None = None  # PEM of the CA that signed the server cert
    server_name: str | None = None  # TLS name to verify instead of the target host
    # send the token in plaintext to a host that is not this machine (a network you trust)
    insecure: bool = False

    def __post_init__(self) -> None:
        if not self.target or ":" not in self.target:
            raise ValueError(f"target must be 'host:port', got {self.target!r}")
        if (self.root_certificates is not None or self.server_name is not None) and not self.tls:
            raise ValueError("root_certificates and server_name need tls=True")
        if self.token and not self.tls and not _loopback(self.target):
            if not self.insecure:
                raise ValueError(
                    f"refusing to send the bearer token in plaintext to {self.target}: anyone on the path could "
                    "read it and use the key. Connect with tls=True (root_certificates= for your own CA), or pass "
                    "insecure=True on a network you trust")
            warnings.warn(f"sending the bearer token in plaintext to {self.target} (insecure=True)", stacklevel=3)

    @classmethod
    def create(
        cls,
        target: str,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | str | Path | None = None,
        server_name: str | None = None,
        insecure: bool = False,
    ) -> ChannelConfig:
        """Build a config; root_certificates may be PEM bytes or a path to a PEM file.

        Raises:
            ValueError: a token would go in plaintext to a host that is not this machine, and
                `insecure` is not set.
        """
        if isinstance(root_certificates, (str, Path)):
            root_certificates = Path(root_certificates).read_bytes()
            tls = True
        return cls(target, token or None, tls or server_name is not None, root_certificates, server_name, insecure)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata carrying the bearer token (empty without a token)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def _options(self) -> list[tuple[str, object]]:
        options: list[tuple[str, object]] = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
        ]
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return options

    def sync_channel(self) -> grpc.Channel:
        """A blocking channel."""
        if self.tls:
            creds = grpc.ssl_channel_credentials(root_certificates=self.root_certificates)
            return grpc.secure_channel(self.target, creds, options=self._options())
        return grpc.insecure_channel(self.target, options=self._options())

    def aio_channel(self) -> grpc.aio.Channel:
        """An asyncio channel (create it inside the event loop that uses it)."""
        if self.tls:
            creds = grpc.ssl_channel_credentials(root_certificates=self.root_certificates)
            return grpc.aio.secure_channel(self.target, creds, options=self._options())
        return grpc.aio.insecure_channel(self.target, options=self._options())
