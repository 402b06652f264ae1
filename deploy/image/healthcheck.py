"""Container health check of the paramserver image: ask the shard(s) in this container for grpc.health.v1 status.

Exit 0 when every shard answers SERVING, 1 otherwise (the HEALTHCHECK contract). Which address to ask:

- PS_HEALTH_ADDR=host:port[,host:port...] when set;
- otherwise it reads the command line of the ps-server process in this container: the port of
  `--shard-index I --peers ...` (or `--port`), or the ports `--port .. --port+N-1` of `ps-server --shards N`,
  on 127.0.0.1 (or on `--host` when that is a specific address);
- a container without a ps-server process (a worker) is reported healthy: there is nothing to check.

A ps-serve container (serving copies, deploy/k8s/components/serving) is healthy once its copies hold a whole
version of every shard: it asks the Serving service's Status (`ready`) on ps-serve's `--port` (on 127.0.0.1, or on
`--host` when that is a specific address), or on PS_HEALTH_SERVING_ADDR=host:port when that is set. ps-serve
serves no grpc.health.v1, and its readiness is not a gRPC health status: a copy still taking its shards' state
answers, but is not ready.

TLS shards (`--tls-cert`): the certificate is checked against PS_HEALTH_TLS_CA (default: the shard's own
--tls-cert, right for a self-signed one) with the name PS_HEALTH_TLS_SERVER_NAME; shards that require client
certificates (`--tls-ca`) need PS_HEALTH_TLS_CERT and PS_HEALTH_TLS_KEY. Health checks need no auth token.
"""

from __future__ import annotations

import os
import sys

TIMEOUT = float(os.environ.get("PS_HEALTH_TIMEOUT", "3"))
DEFAULT_PORT = 50051
DEFAULT_SERVING_PORT = 50061  # ps-serve's --port default


def _option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _server_argv(program: str = "ps-server") -> list[str] | None:
    """The argv (after the script) of the oldest `program` process in this container, if any."""
    found: list[tuple[int, list[str]]] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        for i, arg in enumerate(argv[:2]):
            if os.path.basename(arg) == program:
                found.append((int(entry), argv[i + 1 :]))
                break
    return min(found)[1] if found else None


def _targets(argv: list[str]) -> list[str]:
    host = _option(argv, "--host") or "127.0.0.1"
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = "127.0.0.1"
    port = _option(argv, "--port")
    index = _option(argv, "--shard-index")
    peers = _option(argv, "--peers")
    if index is not None:
        if port is None and peers:
            port = [p.strip() for p in peers.split(",") if p.strip()][int(index)].rsplit(":", 1)[1]
        return [f"{host}:{port or DEFAULT_PORT}"]
    first = int(port or DEFAULT_PORT)
    return [f"{host}:{first + i}" for i in range(int(_option(argv, "--shards") or 1))]


def _serving_target(argv: list[str]) -> str:
    """Where a ps-serve process with this argv answers: its --port (default 50061) on its --host or 127.0.0.1."""
    host = _option(argv, "--host") or "127.0.0.1"
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = "127.0.0.1"
    return f"{host}:{_option(argv, '--port') or DEFAULT_SERVING_PORT}"


def check_serving(target: str) -> int:
    """0 when the serving copies at `target` hold a whole version of every shard (Serving.Status: ready), else 1."""
    import grpc

    from paramserver.v1 import ps_pb2

    try:
        with grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)]) as channel:
            status = channel.unary_unary(
                "/paramserver.v1.Serving/Status",
                request_serializer=ps_pb2.ServingStatusRequest.SerializeToString,
                response_deserializer=ps_pb2.ServingStatus.FromString,
            )(ps_pb2.ServingStatusRequest(), timeout=TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy"
        reason = exc.details() if isinstance(exc, grpc.RpcError) and hasattr(exc, "details") else exc
        print(f"{target}: unreachable ({type(exc).__name__}: {reason})")
        return 1
    versions = ", ".join(str(v) for v in status.versions)
    if status.ready:
        print(f"{target}: ready (serving copies of {status.shards} shard(s) at version {versions})")
        return 0
    print(f"{target}: not ready (the copies are still taking their shards' state; versions {versions})")
    return 1


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def _channel(target: str, argv: list[str]):
    import grpc

    options = [("grpc.enable_http_proxy", 0)]
    cert = _option(argv, "--tls-cert")
    if not cert and not os.environ.get("PS_HEALTH_TLS_CA"):
        return grpc.insecure_channel(target, options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(os.environ.get("PS_HEALTH_TLS_CA") or cert),
        private_key=_read(os.environ.get("PS_HEALTH_TLS_KEY")),
        certificate_chain=_read(os.environ.get("PS_HEALTH_TLS_CERT")),
    )
    name = os.environ.get("PS_HEALTH_TLS_SERVER_NAME")
    if name:
        options.append(("grpc.ssl_target_name_override", name))
    return grpc.secure_channel(target, credentials, options=options)


def main() -> int:
    if os.environ.get("PS_HEALTH_SERVING_ADDR"):
        return check_serving(os.environ["PS_HEALTH_SERVING_ADDR"].strip())
    serving = _server_argv("ps-serve")
    if serving is not None and not os.environ.get("PS_HEALTH_ADDR"):
        return check_serving(_serving_target(serving))
    server = _server_argv()
    argv = server or []
    if os.environ.get("PS_HEALTH_ADDR"):
        targets = [t.strip() for t in os.environ["PS_HEALTH_ADDR"].split(",") if t.strip()]
    elif server is not None:
        targets = _targets(argv)
    else:
        print("healthy: no ps-server in this container (a worker); nothing to check")
        return 0

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    status = 0
    for target in targets:
        try:
            with _channel(target, argv) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT
                )
            state = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy"
            # A gRPC error says what went wrong in details(); anything else in its own message.
            reason = exc.details() if isinstance(exc, grpc.RpcError) and hasattr(exc, "details") else exc
            state = f"unreachable ({type(exc).__name__}: {reason})"
        print(f"{target}: {state}")
        if state != "SERVING":
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
