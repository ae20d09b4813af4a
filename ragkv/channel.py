"""gRPC channels for the SDK: plaintext or TLS, and the bearer-token call metadata.

The token travels as `authorization: Bearer <token>` metadata on every call (it is
not a channel credential, so it also works over plaintext on a loopback or a
private network; use TLS anywhere else).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

# Answers carry whole chunk texts; allow messages well above gRPC's 4 MiB default.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    """Where and how a client connects."""

    target: str  # "host:port"
    token: str | None = None  # bearer token; None = no auth header
    tls: bool = False  # TLS with root_certificates (or the system roots)
    root_certificates: bytes | None = None  # PEM of the CA that signed the server cert
    server_name: str | None = None  # TLS name to verify instead of the target host

    def __post_init__(self) -> None:
        if not self.target or ":" not in self.target:
            raise ValueError(f"target must be 'host:port', got {self.target!r}")
        if (self.root_certificates is not None or self.server_name is not None) and not self.tls:
            raise ValueError("root_certificates and server_name need tls=True")

    @classmethod
    def create(
        cls,
        target: str,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | str | Path | None = None,
        server_name: str | None = None,
    ) -> ChannelConfig:
        """Build a config; root_certificates may be PEM bytes or a path to a PEM file."""
        if isinstance(root_certificates, (str, Path)):
            root_certificates = Path(root_certificates).read_bytes()
            tls = True
        return cls(target, token or None, tls or server_name is not None, root_certificates, server_name)

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
