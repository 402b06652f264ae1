"""ps-server: run the shards of a parameter server."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from collections.abc import Sequence

from paramserver.config import ServerConfig, add_arguments, from_arguments
from paramserver.procs import follow_parent
from paramserver.server import heap
from paramserver.server.cluster import ERROR_LINE, PORT_LINE, READY_LINE, LocalCluster
from paramserver.server.replica import DEPOSED_EXIT
from paramserver.server.shard_server import BindError, ShardServer
from paramserver.shard.optimizers import warm_up_optimizer

log = logging.getLogger("paramserver")

EPILOG = """\
examples:
  ps-server --shards 2 --mode sync --workers 2          two shard processes on 127.0.0.1:50051 and :50052
  ps-server --shards 2 --host 0.0.0.0                   reachable from other hosts (advertised by hostname)
  ps-server --shard-index 1 --peers a:50051,b:50051     exactly one shard (what a Kubernetes pod runs)
  ps-server --shards 2 --replicas 2 --coordinator http://127.0.0.1:2379
                                                        each shard with a hot standby (4 processes, an etcd)

Workers connect with: ps-worker --server HOST:PORT (any one shard's address is enough).
"""


def build_parser() -> argparse.ArgumentParser:
    """Return the ps-server argument parser; the job flags come from ServerConfig's fields."""
    parser = argparse.ArgumentParser(
        prog="ps-server",
        description="Run the shards of a paramserver parameter server.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_argument_group("where the shards run")
    where.add_argument(
        "--shards",
        type=int,
        default=1,
        help="number of shard processes to start on this host (default: %(default)s)",
    )
    where.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; 0.0.0.0 for every interface (default: %(default)s)",
    )
    where.add_argument(
        "--port",
        type=int,
        default=None,
        help="port of the first shard; the others follow "
        "consecutively (default: 50051, or the port of this shard in --peers)",
    )
    where.add_argument(
        "--advertise-host",
        default=None,
        help="host name workers should use to reach these "
        "shards (default: --host, or this machine's hostname when binding 0.0.0.0)",
    )
    where.add_argument("--shard-index", type=int, default=None, help="run exactly one shard, this one of --peers")
    where.add_argument(
        "--replica-index",
        type=int,
        default=0,
        help="with --shard-index and --replicas 2: which copy of the shard's part this process is, 0 or 1 "
        "(default: %(default)s); either may be the primary, the coordinator says which",
    )
    where.add_argument(
        "--peers",
        default=None,
        help="comma-separated address of every shard process, in shard order (with --shard-index); with "
        "--replicas 2, each shard's two copies in turn: s0r0,s0r1,s1r0,s1r1,...",
    )
    where.add_argument("--peers-from-stdin", action="store_true", help=argparse.SUPPRESS)
    where.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity (default: %(default)s)",
    )

    add_arguments(parser.add_argument_group("the job (give every shard the same)"), ServerConfig)
    return parser


def _advertised(host: str, advertise_host: str | None) -> str:
    if advertise_host:
        return advertise_host
    return socket.gethostname() if host in ("0.0.0.0", "::", "[::]", "") else host


class _Stop:
    """Set by the first SIGINT or SIGTERM; the process says which once it acts on it (a shard told to stop
    before it served says nothing: its parent says why)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal = ""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.signal = self.signal or signal.Signals(signum).name
        self.event.set()

    def wait(self, timeout: float) -> bool:
        return self.event.wait(timeout)

    def is_set(self) -> bool:
        return self.event.is_set()

    def say(self, who: str = "") -> None:
        if self.signal:
            log.info("%sreceived %s, stopping", who, self.signal)


def _warm_up(config: ServerConfig) -> threading.Thread:
    """Build a throwaway optimizer while the peers are learnt (serve only once warm, so that no Init waits for it).
    Started once the ports are bound, so that a port in use stops the process at once with no import under way;
    joined before the process exits, whatever stops it: torch's import cut off by the interpreter's shutdown ends
    in a traceback or an abort (and the thread is not a daemon, so even an unforeseen exit waits for it)."""
    warm = threading.Thread(target=warm_up_optimizer, args=(config,), name="optimizer-warm-up", daemon=False)
    warm.start()
    return warm


def run_one_shard(args: argparse.Namespace, config: ServerConfig) -> int:
    """Serve exactly one shard until SIGINT/SIGTERM."""
    import torch

    torch.set_num_threads(config.threads)  # the whole process is this one shard (threads clusters leave it be)
    heap.pin_mmap_threshold()
    index, copy = args.shard_index, args.replica_index
    if not 0 <= copy < config.replicas:
        raise SystemExit(f"ps-server: --replica-index {copy} with --replicas {config.replicas} (0 to replicas - 1)")
    if args.peers_from_stdin:
        port = args.port or 0
    else:
        if not args.peers:
            raise SystemExit("ps-server: --shard-index needs --peers (every shard's address, in order)")
        peers = [p.strip() for p in args.peers.split(",") if p.strip()]
        own = index * config.replicas + copy
        if not 0 <= own < len(peers) or len(peers) % config.replicas:
            raise SystemExit(
                f"ps-server: --shard-index {index} --replica-index {copy} is outside the {len(peers)} --peers "
                f"(with --replicas {config.replicas}: {config.replicas} addresses per shard, each shard's in turn)"
            )
        port = args.port if args.port is not None else int(peers[own].rsplit(":", 1)[1])
    stop = _Stop()
    warm: threading.Thread | None = None
    try:
        server = ShardServer.create(config, index, args.host, port, copy)
        warm = _warm_up(config)
        if args.peers_from_stdin:
            print(f"{PORT_LINE} {server.port}", flush=True)
            line = sys.stdin.readline()
            if stop.is_set() or not line.strip():  # the parent gave up on the start (another shard failed)
                return 0 if stop.is_set() else 2
            peers = line.strip().split(",")
        warm.join()
        server.start(peers)
    except (BindError, ValueError) as exc:  # a port taken; a checkpoint of another job in --checkpoint-dir
        if args.peers_from_stdin:  # started by ps-server --shards N (a LocalCluster): it says it, once
            print(f"{ERROR_LINE} {exc}", flush=True)
        else:
            print(f"ps-server: {exc}", file=sys.stderr)
        return 2
    finally:
        if warm is not None:
            warm.join()  # however this start ends: a thread cut off by the interpreter's shutdown dies loudly
    print(f"{READY_LINE} {server.port}", flush=True)
    deposed = server.replication.deposed if server.replication is not None else threading.Event()
    while not stop.wait(0.1):
        if config.exit_when_done and server.shard.done.is_set():
            log.info("shard %d: training is done; stopping", index)
            break
        if deposed.is_set():
            break
    stop.say(f"shard {index}: ")
    server.stop(grace=0.0 if deposed.is_set() else 2.0)
    return DEPOSED_EXIT if deposed.is_set() else 0


def run_local_shards(args: argparse.Namespace, config: ServerConfig) -> int:
    """Start --shards shard processes, print their addresses, and stop them all on SIGINT/SIGTERM."""
    stop = _Stop()
    port = 50051 if args.port is None else args.port
    cluster = LocalCluster(
        config,
        args.shards,
        processes=True,
        host=args.host,
        port=port,
        advertise_host=_advertised(args.host, args.advertise_host),
        log_level=args.log_level,
    )
    try:
        cluster.start()
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"ps-server: {exc}", file=sys.stderr)
        return 1
    for i, address in enumerate(cluster.addresses):
        shard, copy = divmod(i, cluster.copies)
        print(f"shard {shard}{f' copy {copy}' if cluster.copies > 1 else ''}: {address}", flush=True)
    print(f"workers: ps-worker --server {cluster.address}", flush=True)
    status = 0
    while not stop.wait(0.5):
        codes = cluster.poll()
        if all(c == 0 for c in codes):
            log.info("every shard finished: the job is done")
            break
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed and cluster.copies > 1:
            # A copy that died (or was deposed) comes back as its shard's backup while the other copy serves.
            for i, code in failed:
                log.warning("shard process %d exited with status %d; starting it again", i, code)
                try:
                    cluster.restart(i)
                except (RuntimeError, TimeoutError, OSError) as exc:
                    log.error("shard process %d could not start again: %s", i, exc)
            continue
        if failed:
            for i, code in failed:
                log.error("shard %d exited with status %d; stopping the others", i, code)
            status = 1
            break
    stop.say()
    cluster.stop()
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ps-server."""
    follow_parent()  # a shard process of ps-server --shards N (LocalCluster) stops with its parent
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        config = from_arguments(ServerConfig, args)
    except ValueError as exc:
        raise SystemExit(f"ps-server: {exc}") from None
    if args.shard_index is not None:
        return run_one_shard(args, config)
    if args.shards < 1:
        raise SystemExit("ps-server: --shards must be at least 1")
    return run_local_shards(args, config)


if __name__ == "__main__":
    sys.exit(main())
