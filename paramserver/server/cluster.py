"""LocalCluster: N shards on this host, as threads of this process or as subprocesses (tests, demo, ps-server)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING

from paramserver.config import ServerConfig
from paramserver.procs import child_env
from paramserver.server.shard_server import ShardServer

if TYPE_CHECKING:
    from paramserver.coord import PartConfig

log = logging.getLogger(__name__)

# What a shard subprocess prints on stdout, so the parent learns its port and when it serves.
PORT_LINE = "PARAMSERVER-PORT"
READY_LINE = "PARAMSERVER-READY"
ERROR_LINE = "PARAMSERVER-ERROR"  # then why it cannot start (a port taken, ...), for the parent to say once


def config_to_args(config: ServerConfig) -> list[str]:
    """Render a ServerConfig as ps-server flags (the inverse of the CLI's parsing)."""
    args = []
    for name, value in vars(config).items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            args += [flag, str(value)]
    return args


class LocalCluster:
    """Start `shards` shards on `host`, ports from `port` (0: the OS picks each); stop them on exit.

    Threads (the default) are cheap and let tests look inside the shards (`cluster.shards`); processes are
    what production runs and what fault tests kill (`cluster.kill(i)`). With `config.replicas` 2 each shard runs
    as two copies: servers (and processes) number `shards * 2`, shard i's copies at 2i and 2i + 1, each with its
    own ports; `addresses` lists them all in that order.
    """

    def __init__(
        self,
        config: ServerConfig | None = None,
        shards: int = 1,
        *,
        processes: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        start_timeout: float = 60.0,
        log_level: str = "WARNING",
    ) -> None:
        if shards < 1:
            raise ValueError(f"shards must be at least 1, not {shards}")
        self.config = config or ServerConfig()
        self.num_shards = shards
        self.copies = self.config.replicas
        self.num_servers = shards * self.copies
        self.processes = processes
        self.host = host
        self.base_port = port
        self.advertise_host = advertise_host or host
        self.start_timeout = start_timeout
        self.log_level = log_level
        self.addresses: list[str] = []
        self.servers: list[ShardServer] = []
        self.procs: list[subprocess.Popen[str]] = []
        self._drains: list[threading.Thread] = []
        self._started = False

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> LocalCluster:
        """Bind and start every shard; return once all serve."""
        if self._started:
            return self
        self._started = True
        try:
            if self.processes:
                self._start_processes()
            else:
                self._start_threads()
        except BaseException:
            self.stop()
            raise
        return self

    def _port(self, i: int) -> int:
        return self.base_port + i if self.base_port else 0

    def _shard_config(self, i: int) -> ServerConfig:
        """Server i's config: the job's, with its own metrics, data and replication ports (base + i) where they
        are fixed."""
        c = self.config

        def own(port: int | None) -> int | None:
            return port + i if port else port

        return c.replace(
            metrics_port=own(c.metrics_port), data_port=own(c.data_port) or 0, replication_port=own(c.replication_port)
        )

    def _start_threads(self) -> None:
        for i in range(self.num_servers):
            shard, copy = divmod(i, self.copies)
            self.servers.append(ShardServer.create(self._shard_config(i), shard, self.host, self._port(i), copy))
        self.addresses = [f"{self.advertise_host}:{s.port}" for s in self.servers]
        for server in self.servers:
            server.start(self.addresses)

    def _spawn(self, i: int, port: int) -> subprocess.Popen[str]:
        shard, copy = divmod(i, self.copies)
        cmd = [
            sys.executable, "-m", "paramserver.server.cli", "--shard-index", str(shard), "--replica-index", str(copy),
            "--peers-from-stdin",
            "--host", self.host, "--port", str(port), "--log-level", self.log_level,
            *config_to_args(self._shard_config(i)),
        ]  # fmt: skip
        # A new session: a Ctrl-C in the terminal reaches only the parent, which stops shards in order.
        return subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,
            env=child_env(),  # SIGTERM when this process dies: no shard outlives it, each checkpoints
        )

    def _start_processes(self) -> None:
        self.procs = [self._spawn(i, self._port(i)) for i in range(self.num_servers)]
        deadline = time.monotonic() + self.start_timeout
        ports = [int(self._expect(p, PORT_LINE, deadline)) for p in self.procs]
        self.addresses = [f"{self.advertise_host}:{port}" for port in ports]
        for i in range(self.num_servers):
            self._serve(i, deadline)

    def _serve(self, i: int, deadline: float) -> None:
        """Tell shard process i the peer list, wait until it serves, and keep draining its output."""
        proc = self.procs[i]
        assert proc.stdin is not None
        proc.stdin.write(",".join(self.addresses) + "\n")
        proc.stdin.close()
        self._expect(proc, READY_LINE, deadline)
        # Keep draining stdout so a chatty shard can never block on a full pipe.
        drain = threading.Thread(target=_drain, args=(proc,), name=f"shard{i}-stdout", daemon=True)
        drain.start()
        self._drains.append(drain)

    def restart(self, index: int) -> None:
        """Start shard process `index` again on its old port (after it died or was killed); it restores its
        newest checkpoint when the config has a checkpoint_dir. Call it from a thread that lives as long as the
        process should: Linux stops a child when the thread that started it ends (paramserver.procs)."""
        if not self.processes:
            raise RuntimeError("only shard processes can be restarted")
        old = self.procs[index]
        if old.poll() is None:
            raise RuntimeError(f"shard {index} (pid {old.pid}) is still running; kill or stop it first")
        port = int(self.addresses[index].rsplit(":", 1)[1])
        self.procs[index] = self._spawn(index, port)
        deadline = time.monotonic() + self.start_timeout
        self._expect(self.procs[index], PORT_LINE, deadline)
        self._serve(index, deadline)

    @staticmethod
    def _expect(proc: subprocess.Popen[str], tag: str, deadline: float) -> str:
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(
                    f"shard process {proc.pid} exited with status {proc.wait()} before serving (see its log above)"
                )
            if line.startswith(tag):
                return line.split()[1]
            if line.startswith(ERROR_LINE):
                proc.wait()
                raise RuntimeError(line[len(ERROR_LINE) :].strip())
        raise TimeoutError(f"shard process {proc.pid} did not report {tag} within the start timeout")

    def stop(self, grace: float = 1.0) -> None:
        """Stop every shard (threads: graceful; processes: SIGTERM, then SIGKILL after 10 s). Idempotent."""
        for server in self.servers:
            server.stop(grace)
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            if proc.stdin is not None:
                proc.stdin.close()  # a shard still waiting for the peer list stops at once
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for drain in self._drains:  # each ends at its process's last line: none writes while this process exits
            drain.join(timeout=5)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- access ------------------------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The first server's address: enough for a worker to find all shards."""
        if not self.addresses:
            raise RuntimeError("the cluster is not started")
        return self.addresses[0]

    @property
    def shards(self) -> list:  # list[Shard]; untyped to keep this module free of shard imports at type level
        """The Shard objects (thread mode only)."""
        if self.processes:
            raise RuntimeError("shards run in other processes; use threads (processes=False) to look inside")
        return [s.shard for s in self.servers]

    def poll(self) -> list[int | None]:
        """Exit status of each shard process (None while it runs); all None in thread mode."""
        return [p.poll() for p in self.procs] if self.procs else [None] * self.num_servers

    def wait_in_sync(self, shard: int, timeout: float = 60.0) -> PartConfig:
        """With --replicas 2: wait until both copies of `shard` are in its in-sync set (a backup that started
        takes the whole state first); return the part's configuration (`.primary`: the copy that serves).
        TimeoutError after `timeout` seconds."""
        from paramserver.coord import Etcd, PartRegister

        if not self.config.coordinator:
            raise RuntimeError("the cluster has no coordinator: its shards are not replicated")
        register = PartRegister(Etcd(self.config.coordinator), self.config.job_name, shard)
        deadline = time.monotonic() + timeout
        while True:
            cfg = register.read()
            if cfg is not None and len(cfg.in_sync) == 2:
                return cfg
            if time.monotonic() > deadline:
                raise TimeoutError(f"shard {shard}'s copies were not in sync after {timeout:.0f} s: {cfg}")
            time.sleep(0.05)

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send a signal to one shard process (fault tests)."""
        if not self.processes:
            raise RuntimeError("only shard processes can be killed")
        os.kill(self.procs[index].pid, sig)


def _drain(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
