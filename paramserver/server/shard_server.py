"""Serve one shard: a gRPC server with the ParameterServer and standard health services."""

from __future__ import annotations

import errno
import functools
import logging
import socket
import threading
from collections.abc import Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from paramserver.config import ServerConfig, copy_dir
from paramserver.coord import Etcd
from paramserver.metrics import MetricsServer
from paramserver.security import TokenAuth, read_token, server_credentials, server_ssl_context
from paramserver.server.exchange import ExchangeHandler
from paramserver.server.frame_service import FrameService
from paramserver.server.replica import Replication
from paramserver.server.service import Endpoints, ParameterServerServicer, add_to_server
from paramserver.shard.state import Shard
from paramserver.transport.socket_client import split_host
from paramserver.transport.socket_server import FrameServer, tcp_listener
from paramserver.v1 import ps_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Server options: gRPC's own receive cap sits well above max_message_bytes, which the servicer enforces
    itself on client streams (so an oversized chunk is refused before anything is applied, see ClientStream)."""
    options = [
        ("grpc.max_receive_message_length", max(64 << 20, 2 * config.max_message_bytes)),
        ("grpc.max_send_message_length", config.max_message_bytes),
    ]
    if config.replicas > 1:  # workers ping a copy every second to notice one that went silent (psclient)
        options += [
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_ping_strikes", 0),
        ]
    return options


class BindError(OSError):
    """A shard cannot listen where it was told to (the port is taken, or the address is not this host's)."""


def bind_problem(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on now (as a person would say it), or None when it can."""
    try:
        tcp_listener(host, port).close()
    except OSError as exc:
        return "the port is in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc)).lower()
    return None


def bind_error(index: int, what: str, host: str, port: int, flag: str, why: str | None = None) -> BindError:
    """Say why shard `index` could not bind its `what` to host:port, and which flag chooses another port."""
    why = why or bind_problem(host, port) or "the system refused it"
    return BindError(
        f"shard {index} cannot serve its {what} on {host}:{port}: {why}; choose another port with {flag} "
        "(0: any free port)"
    )


class ShardServer:
    """A started gRPC server for one shard. Bind with `create`, give it the peer list, then `start`."""

    def __init__(
        self,
        shard: Shard,
        server: grpc.Server,
        port: int,
        health_servicer: health.HealthServicer,
        servicer: ParameterServerServicer,
    ) -> None:
        self.shard = shard
        self.servicer = servicer
        self.endpoints = servicer.endpoints  # filled in by `start` as the doorbell and the data socket listen
        self.frames = FrameService(servicer.handler)
        self._doorbell: FrameServer | None = None
        self._data: FrameServer | None = None
        self._data_listener: socket.socket | None = None
        self.port = port
        self.host = "127.0.0.1"  # where the gRPC port listens; the metrics port listens there too
        self.metrics_port: int | None = None
        self._server = server
        self._health = health_servicer
        self._metrics: MetricsServer | None = None
        self._pool: futures.ThreadPoolExecutor | None = None
        self._stopped = threading.Event()
        self.copy = 0  # which copy of its shard this process is (--replicas 2)
        self.replication: Replication | None = None

    @classmethod
    def create(
        cls, config: ServerConfig, index: int = 0, host: str = "127.0.0.1", port: int = 0, copy: int = 0
    ) -> ShardServer:
        """Bind a shard's server to host:port (0: the OS picks) without starting it; `copy`: which of the shard's
        copies this is (--replicas 2)."""
        if not 0 <= copy < config.replicas:
            raise ValueError(f"copy {copy} of a shard with {config.replicas} replicas")
        config = copy_dir(config, copy)
        shard = Shard(config, index)
        # Each sync-mode pull may wait for its round in a thread of its own, so leave room per worker.
        pool = futures.ThreadPoolExecutor(
            max_workers=max(16, 4 * config.workers + 8), thread_name_prefix=f"shard{index}"
        )
        interceptors = [TokenAuth(read_token(config.auth_token_file))] if config.auth_token_file else []
        # so_reuseport off: a second server on the same port must fail, not silently share it.
        server = grpc.server(pool, interceptors=interceptors, options=[*grpc_options(config), ("grpc.so_reuseport", 0)])
        servicer = ParameterServerServicer(shard, Endpoints(), ExchangeHandler(shard))
        add_to_server(servicer, server)
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_ca)
        # Ask first: gRPC's own failure is a C-core log line and no reason.
        if port and (why := bind_problem(host, port)) is not None:
            pool.shutdown(wait=False)
            raise bind_error(index, "gRPC port", host, port, "--port", why)
        try:  # grpcio raises RuntimeError("Failed to bind ..."), older releases returned 0
            if credentials is None:
                bound = server.add_insecure_port(f"{host}:{port}")
            else:
                bound = server.add_secure_port(f"{host}:{port}", credentials)
        except RuntimeError:
            bound = 0
        if bound == 0:
            pool.shutdown(wait=False)
            raise bind_error(index, "gRPC port", host, port, "--port")
        instance = cls(shard, server, bound, health_servicer, servicer)
        instance._pool = pool
        instance.host = host
        instance.copy = copy
        if config.data_socket:
            try:
                instance._data_listener = tcp_listener(host, config.data_port)
            except OSError:
                server.stop(None)
                pool.shutdown(wait=False)
                raise bind_error(index, "data socket", host, config.data_port, "--data-port") from None
        return instance

    def start(self, addresses: Sequence[str]) -> None:
        """Restore the newest checkpoint if there is one, then serve, knowing every shard's address (with
        --replicas 2, every copy's, each shard's in turn; this copy then first takes its role: see
        paramserver.server.replica)."""
        metrics_port = self.shard.config.metrics_port
        if metrics_port is not None:  # first: a port that is taken must fail the start before anything changes
            try:
                self._metrics = MetricsServer(self.shard.metrics.registry, metrics_port, self.host)
            except OSError:
                raise bind_error(self.shard.index, "metrics", self.host, metrics_port, "--metrics-port") from None
            self.metrics_port = self._metrics.port
        copies = self.shard.config.replicas
        if copies > 1:
            if len(addresses) % copies or not 0 <= self.shard.index * copies + self.copy < len(addresses):
                raise ValueError(
                    f"with --replicas {copies} the peers list every copy of every shard ({copies} per shard, in "
                    f"turn); {len(addresses)} addresses cannot hold shard {self.shard.index} copy {self.copy}"
                )
            self.shard.replica_addresses = tuple(addresses)
            own = addresses[self.shard.index * copies + self.copy]
            addresses = list(addresses[::copies])
        self.shard.addresses = tuple(addresses)
        if copies > 1:
            c = self.shard.config
            assert c.coordinator is not None  # ServerConfig requires one with replicas
            try:
                self.replication = Replication(
                    self.shard,
                    self.copy,
                    Etcd(c.coordinator, timeout=max(1.0, 2 * c.replica_timeout)),
                    self.host,
                    split_host(own),
                    on_ready=self._set_ready,
                )
            except OSError:
                c = self.shard.config
                raise bind_error(
                    self.shard.index, "replication port", self.host, c.replication_port, "--replication-port"
                ) from None
            self.replication.start()
        else:
            self.shard.restore()
        self.shard.start()
        frames, rejected = self.frames, self.servicer.handler.rejected
        c = self.shard.config
        if self.shard.config.shared_memory:
            # Same-host workers' Exchanges over a Unix socket (see paramserver.transport.socket_server).
            self._doorbell = FrameServer(
                frames.verify,
                frames.exchange,
                rejected,
                payload_limit=frames.rows_payload_limit,
                max_pending=c.max_pending_connections,
                on_refused=functools.partial(self.shard.metrics.refused_connection, "doorbell"),
            )
            self.endpoints.doorbell = str(self._doorbell.address)
        if self._data_listener is not None:
            # Other hosts' workers' tensors, as raw bytes over TCP (TLS like the gRPC port when it has TLS).
            self._data = FrameServer(
                frames.verify,
                frames.exchange,
                rejected,
                listener=self._data_listener,
                tls=server_ssl_context(c.tls_cert, c.tls_key, c.tls_ca),
                payload_limit=frames.payload_limit,
                max_pending=c.max_pending_connections,
                on_refused=functools.partial(self.shard.metrics.refused_connection, "data"),
            )
            self.endpoints.data_port = self._data.port
        self._server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)  # alive (the liveness probe)
        # Ready (the readiness probe, on the service's name): always without replicas; with them, while this copy
        # counts (the primary, or a backup that holds every acknowledged update).
        self._set_ready(self.replication is None or self.replication.ready)
        log.info("shard %d of %d serving on port %d", self.shard.index, len(addresses), self.port)

    def _set_ready(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        self._health.set(SERVICE_NAME, status)

    @property
    def data_port(self) -> int:
        """The port of the shard's data socket (0: none)."""
        return self.endpoints.data_port

    def stop(self, grace: float = 1.0) -> None:
        """Stop cleanly: let a sync round in progress close, finish the RPCs in flight, write a final checkpoint.

        Each wait is bounded by `grace` seconds. Waiting pulls are answered UNAVAILABLE (clients retry).
        """
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._health.enter_graceful_shutdown()
        self.shard.drain(grace)
        self.shard.stop_waiting()
        self._server.stop(grace).wait()
        if self.replication is not None:
            self.replication.stop()
        for bell in (self._doorbell, self._data):
            if bell is not None:
                bell.close(grace)
        if self._data is None and self._data_listener is not None:
            self._data_listener.close()  # created, never started
        self.shard.close()
        if self._metrics is not None:
            self._metrics.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        log.info("shard %d stopped at version %d", self.shard.index, self.shard.version)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops; return whether it did."""
        return self._server.wait_for_termination(timeout)
