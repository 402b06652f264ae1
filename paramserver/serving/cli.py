"""ps-serve: serving copies of a running job's shards, following training, answering reads."""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import threading
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from paramserver.errors import PSError
from paramserver.procs import follow_parent
from paramserver.serving.copy import ShardCopy
from paramserver.serving.server import ServingCopies, serve

log = logging.getLogger("paramserver")

READY_LINE = "PS-SERVE-READY"  # then the port, once every copy holds a whole version (for scripts and tests)

EPILOG = """\
examples:
  ps-serve --server 127.0.0.1:50051 --port 50061       copies of every shard of the job, on 127.0.0.1:50061
  ps-serve --server ps-0.ps:50051 --shard-index 1 --host 0.0.0.0 --port 50061
                                                       one shard's copy (one pod per shard)
  ps-serve --peers ps-0.ps:50051,ps-1.ps:50051 --shard-index 1 --host 0.0.0.0
                                                       the same, asking shard 1 itself
  ps-serve --server 127.0.0.1:50051 --from model.safetensors
                                                       ready at once with a saved file's values, then following
  ps-serve --from model.safetensors --port 50061        a saved file alone, following nothing

Read from it with worker.ServingClient("HOST:PORT") (lookup, pull, version) or worker.serve(model, "HOST:PORT").
A copy holds values only (no optimizer state, no log), asks its shard for what changed since the version it holds
(an answer as soon as a newer version shows: rows reach it within milliseconds), never acknowledges anything
(training never waits for it), follows a failover (--replicas 2) and takes a whole state again after a shard
restarted without a log. Writes (Init, Push, Exchange, Join, Attach) are refused with FAILED_PRECONDITION.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ps-serve",
        description="Serve a running job's model: copies of its shards that follow training, for inference.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--server", default=None, help="any one shard of the job, HOST:PORT")
    parser.add_argument(
        "--peers",
        default=None,
        help="every shard's address, in order, as ps-server --peers takes them (instead of --server): with "
        "--shard-index I, the copy of shard I asks shard I itself (one pod per shard)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50061, help="port to serve on; 0 picks one (default: %(default)s)")
    parser.add_argument(
        "--shard-index",
        type=int,
        action="append",
        default=None,
        help="hold only this shard's copy (repeatable; default: every shard)",
    )
    parser.add_argument(
        "--lookup-port",
        type=int,
        default=0,
        help="port of the lookup socket (lookups framed over plain TCP, which ServingClient uses when it can reach "
        "it: several times cheaper per request than gRPC); 0 picks one, -1 opens none (default: %(default)s)",
    )
    parser.add_argument(
        "--from",
        dest="seed_from",
        metavar="FILE",
        default=None,
        help="a model file of the job's model (PSClient.save, ps-worker --save-model): served at once, each copy "
        "ready without waiting for its shard's whole state, which it takes beside the file's and swaps in when "
        "whole (a cold start of seconds for any table size; the file's values until then); without --server, "
        "serve the file alone, following nothing (a snapshot, a rollback, a model whose job is gone)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics (paramserver_serving_lag_seconds, ...) on this port",
    )
    parser.add_argument(
        "--wait", type=float, default=120.0, help="seconds to wait for the job to hold a model (default: %(default)s)"
    )
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default: %(default)s)")
    return parser


def metrics(copies: ServingCopies) -> CollectorRegistry:
    """The serving copies' metrics, read at each scrape."""
    registry = CollectorRegistry()
    lag = Gauge(
        "paramserver_serving_lag_seconds",
        "Seconds since this shard's copy last heard from its shard: its rows are at most this old plus one apply",
        ["shard"],
        registry=registry,
    )
    version = Gauge("paramserver_serving_version", "The version a shard's copy holds", ["shard"], registry=registry)
    rows = Gauge("paramserver_serving_rows", "Rows a shard's copy holds", ["shard"], registry=registry)
    held = Gauge("paramserver_serving_bytes", "Bytes a shard's copy holds", ["shard"], registry=registry)
    ready = Gauge("paramserver_serving_ready", "1 once every copy holds a whole version", registry=registry)
    ready.set_function(lambda: float(copies.ready))
    for index, c in copies.copies.items():
        s = str(index)
        lag.labels(s).set_function(functools.partial(_silent, c))
        version.labels(s).set_function(functools.partial(getattr, c, "version"))
        rows.labels(s).set_function(functools.partial(getattr, c, "rows"))
        held.labels(s).set_function(functools.partial(getattr, c, "nbytes"))
    return registry


def _silent(copy: ShardCopy) -> float:
    return time.monotonic() - copy.heard


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.peers:
        peers = [p.strip() for p in args.peers.split(",") if p.strip()]
        first = args.shard_index[0] if args.shard_index else 0
        if not 0 <= first < len(peers):
            parser.error(f"--shard-index {first}: --peers names {len(peers)} shards")
        args.server = args.server or peers[first]
    if not args.server and not args.seed_from:
        parser.error("give --server HOST:PORT (any shard of the job) or --peers, or --from FILE alone")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    follow_parent()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        server, copies, port = serve(
            args.server,
            args.host,
            args.port,
            args.shard_index,
            timeout=args.wait,
            seed_from=args.seed_from,
            lookup_port=None if args.lookup_port < 0 else args.lookup_port,
        )
    except (PSError, OSError, ValueError) as exc:
        print(f"ps-serve: {exc}", flush=True)
        return 1
    if args.metrics_port is not None:
        start_http_server(args.metrics_port, addr=args.host, registry=metrics(copies))
    what = f"from {args.server}" if args.server else f"of {args.seed_from} (following nothing)"
    print(
        f"ps-serve: {len(copies.copies)} shard copies of model {copies.topology.model_digest[:12]} {what}, serving "
        f"on {args.host}:{port}"
        + (f" (lookups also on TCP port {copies.lookup_socket.port})" if copies.lookup_socket is not None else ""),
        flush=True,
    )
    while not stop.is_set() and not copies.ready:
        stop.wait(0.05)
    if copies.ready:
        versions = ", ".join(str(c.version) for c in copies.copies.values())
        print(f"{READY_LINE} {port} (version {versions})", flush=True)
    stop.wait()
    copies.stop()
    server.stop(grace=1).wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
