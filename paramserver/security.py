"""TLS / mutual TLS credentials and the optional shared bearer token, for both sides.

The token is compared in constant time and never logged. The standard health service stays open without a
token, so Kubernetes' gRPC probes work; everything else requires it when one is set.
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from paramserver.errors import Unauthenticated, abort, status_of

HEALTH_PREFIX = "/grpc.health.v1.Health/"
_DENIED = "missing or wrong bearer token: start the worker with the job's --auth-token-file"


def read_token(path: str) -> str:
    """Read a bearer token from a file (surrounding whitespace stripped); refuse an empty one."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(cert: str | None, key: str | None, ca: str | None) -> grpc.ServerCredentials | None:
    """TLS for a shard from PEM files; with a CA, clients must present a certificate it signed (mutual TLS)."""
    if not cert and not key:
        if ca:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key on the server")
        return None
    if not (cert and key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    pair = (Path(key).read_bytes(), Path(cert).read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=_read(ca), require_client_auth=bool(ca))


def channel_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials | None:
    """TLS for a client from PEM files (None: plaintext); cert and key present a client certificate."""
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both --tls-cert and --tls-key")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca), private_key=_read(key), certificate_chain=_read(cert)
    )


def server_ssl_context(cert: str | None, key: str | None, ca: str | None) -> ssl.SSLContext | None:
    """The same TLS as `server_credentials`, for a shard's data socket (None: plaintext, like its gRPC port)."""
    if not (cert and key):
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    if ca:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(ca)
    return context


def client_ssl_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The same TLS as `channel_credentials`, for a worker's data-socket connections (None: plaintext)."""
    if not (ca or cert or key):
        return None
    context = ssl.create_default_context(cafile=ca)  # the system's CAs when none is given, as gRPC does
    if cert and key:
        context.load_cert_chain(cert, key)
    return context


class TokenAuth(grpc.ServerInterceptor):
    """Refuse every call but health checks unless it carries `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        sent_bytes = sent.encode() if isinstance(sent, str) else bytes(sent)
        if hmac.compare_digest(sent_bytes, self._expected):
            return handler
        return _denying(handler)


def _deny(request: Any, context: grpc.ServicerContext) -> Any:
    abort(context, status_of(Unauthenticated(_DENIED), "authentication"))


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that refuses with UNAUTHENTICATED."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        _deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Add `authorization: Bearer <token>` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._header]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base: Any, metadata: list[tuple[str, str]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = base.wait_for_ready
        self.compression = getattr(base, "compression", None)


def open_channel(
    address: str,
    options: list[tuple[str, Any]],
    credentials: grpc.ChannelCredentials | None = None,
    token: str | None = None,
) -> grpc.Channel:
    """A channel to one shard: TLS when credentials are given, the bearer token on every call when set."""
    if credentials is not None:
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    if token:
        channel = grpc.intercept_channel(channel, _BearerToken(token))
    return channel
