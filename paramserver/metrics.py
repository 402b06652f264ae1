"""Prometheus metrics of one shard (the shard's state and its server both count), on a registry of its own (several
shards can share a process in tests).

Labels stay low-cardinality: the shard index, a result or reason from a fixed set, and worker ranks (bounded by
the job's worker count), never worker ids. The registry also carries the standard process_* metrics (resident
memory, CPU, file descriptors) and paramserver_memory_limit_bytes, the memory the shard may use, so an alert can
compare the two (deploy/monitoring/alerts.yml).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from paramserver.shard.update import Update

_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_STALENESS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128)
# cgroup v1 writes "no limit" as a huge page-aligned number (LONG_MAX rounded down); anything above this is none.
_NO_CGROUP_LIMIT = 1 << 60


def cgroup_memory_limit(
    cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int:
    """The tightest memory limit of this process's cgroup and its ancestors (v2 memory.max, v1
    memory.limit_in_bytes); 0 where none is set or there are no cgroups."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return 0
    candidates: list[Path] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        rel = path.strip("/")
        if controllers == "":  # v2, unified
            base, name = cgroup_root, "memory.max"
        elif "memory" in controllers.split(","):  # v1
            base, name = cgroup_root / "memory", "memory.limit_in_bytes"
        else:
            continue
        # A container sees its own cgroup as the root of the hierarchy while /proc/self/cgroup may still name the
        # host's path: try the named directory and each of its ancestors, down to the root, and keep the lowest.
        parts = rel.split("/") if rel else []
        candidates += [base.joinpath(*parts[:n], name) for n in range(len(parts), -1, -1)]
    limits = []
    for file in candidates:
        try:
            text = file.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < _NO_CGROUP_LIMIT:
            limits.append(int(text))
    return min(limits, default=0)


def memory_limit() -> float:
    """Bytes of memory this process may use: its cgroup's limit (a container's, e.g. a Kubernetes pod's
    resources.limits.memory), else the machine's physical memory."""
    limit = cgroup_memory_limit()
    if limit:
        return float(limit)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float("inf")


class TableFigures(Protocol):
    """What the metrics read of one sparse table (paramserver.shard.sparse.tables.TableFigures)."""

    @property
    def rows(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def allocated_bytes(self) -> int: ...
    @property
    def rows_admitted(self) -> int: ...
    @property
    def rows_evicted(self) -> int: ...
    @property
    def ids_seen(self) -> int: ...


class _TableCollector(Collector):
    """Per-table figures, read from the tables at each scrape (labels: shard, table; tables are few and named by
    the model)."""

    def __init__(self, shard: str, tables: Callable[[], Sequence[tuple[str, TableFigures]]]) -> None:
        self._shard = shard
        self._tables = tables

    def collect(self) -> Iterator[Metric]:
        labels = ["shard", "table"]
        rows = GaugeMetricFamily("paramserver_table_rows", "Rows a sparse table holds on this shard", labels=labels)
        size = GaugeMetricFamily(
            "paramserver_table_bytes",
            "Bytes of a sparse table's rows as --max-table-bytes counts them (values, optimizer state, index)",
            labels=labels,
        )
        allocated = GaugeMetricFamily(
            "paramserver_table_allocated_bytes", "Memory allocated for a sparse table on this shard", labels=labels
        )
        admitted = CounterMetricFamily(
            "paramserver_table_rows_admitted", "Rows made (IDs admitted) in a sparse table", labels=labels
        )
        evicted = CounterMetricFamily(
            "paramserver_table_rows_evicted", "Rows dropped by eviction (age, capacity, memory cap)", labels=labels
        )
        seen = CounterMetricFamily("paramserver_table_ids_seen", "IDs in the updates of a sparse table", labels=labels)
        for name, t in self._tables():
            key = [self._shard, name]
            rows.add_metric(key, t.rows)
            size.add_metric(key, t.nbytes)
            allocated.add_metric(key, t.allocated_bytes)
            admitted.add_metric(key, t.rows_admitted)
            evicted.add_metric(key, t.rows_evicted)
            seen.add_metric(key, t.ids_seen)
        yield from (rows, size, allocated, admitted, evicted, seen)


class ShardMetrics:
    """Every metric a shard exports, named paramserver_*."""

    def __init__(self, shard: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, s = self.registry, str(shard)
        self.pushes = Counter("paramserver_pushes", "Pushes taken, by result", ["shard", "result"], registry=r)
        self.pulls = Counter("paramserver_pulls", "Pulls served", ["shard"], registry=r).labels(s)
        self.lookups = Counter(
            "paramserver_lookups", "Exchanges that looked sparse-table rows up", ["shard"], registry=r
        ).labels(s)
        self.bytes_in = Counter(
            "paramserver_received_bytes", "Tensor bytes received (push, init)", ["shard"], registry=r
        ).labels(s)
        self.bytes_out = Counter("paramserver_sent_bytes", "Tensor bytes sent (pull)", ["shard"], registry=r).labels(s)
        self.apply_seconds = Histogram(
            "paramserver_apply_seconds", "Time of one optimizer step", ["shard"], buckets=_LATENCY, registry=r
        ).labels(s)
        self.round_wait = Histogram(
            "paramserver_round_wait_seconds",
            "Sync: time from a round's first gradient to its apply",
            ["shard"],
            buckets=_LATENCY,
            registry=r,
        ).labels(s)
        self.staleness = Histogram(
            "paramserver_staleness",
            "Async: versions between a gradient's base and apply",
            ["shard"],
            buckets=_STALENESS,
            registry=r,
        ).labels(s)
        self.live_workers = Gauge("paramserver_live_workers", "Workers holding a lease", ["shard"], registry=r).labels(
            s
        )
        self.version = Gauge("paramserver_version", "Updates applied", ["shard"], registry=r).labels(s)
        self.rejected = Counter("paramserver_rejected", "Requests refused, by reason", ["shard", "reason"], registry=r)
        self.stragglers = Counter(
            "paramserver_straggler_rounds",
            "Sync rounds whose last gradient came from this rank",
            ["shard", "rank"],
            registry=r,
        )
        self.last_straggler = Gauge(
            "paramserver_last_straggler_rank",
            "Rank of the last worker to arrive in the latest sync round",
            ["shard"],
            registry=r,
        ).labels(s)
        self.evictions = Counter(
            "paramserver_evictions", "Workers evicted after their lease ran out", ["shard"], registry=r
        ).labels(s)
        self.connections_refused = Counter(
            "paramserver_socket_connections_refused",
            "Doorbell and data-socket connections ended before they proved themselves, by reason (pending_cap: "
            "too many at once; handshake_timeout: no valid hello in time)",
            ["shard", "socket", "reason"],
            registry=r,
        )
        self._replica_metrics(r, s)
        _process_metrics(r, s)
        self._shard = s

    def _replica_metrics(self, r: CollectorRegistry, s: str) -> None:
        """--replicas 2 (paramserver.server.replica): which copy serves, whether its backup counts, what failed."""
        self.primary = Gauge(
            "paramserver_replica_primary",
            "1 while this copy is its shard's primary, 0 as the backup",
            ["shard"],
            registry=r,
        ).labels(s)
        self.backup_in_sync = Gauge(
            "paramserver_replica_backup_in_sync",
            "A primary's backup holds every acknowledged update (1), or the primary acknowledges alone (0)",
            ["shard"],
            registry=r,
        ).labels(s)
        self.takeovers = Counter(
            "paramserver_replica_takeovers",
            "Times this copy took over as primary from its rival",
            ["shard"],
            registry=r,
        ).labels(s)
        self.backup_updates = Counter(
            "paramserver_replica_backup_updates",
            "Updates a primary sent its live backup, by how their gradient went: forwarded (the pushes as they "
            "arrived, then a record naming them) or whole (the record with the gradient, after it applied)",
            ["shard", "how"],
            registry=r,
        )
        self.backup_lost = Counter(
            "paramserver_replica_backup_dropped",
            "Times a primary went on without its backup (silent, its link broken, or restarted)",
            ["shard"],
            registry=r,
        ).labels(s)

    def watch_tables(self, tables: Callable[[], Sequence[tuple[str, TableFigures]]]) -> None:
        """Export the figures of the sparse tables `tables()` names at each scrape."""
        self.registry.register(_TableCollector(self._shard, tables))

    def pushed(self, result: str) -> None:
        self.pushes.labels(self._shard, result).inc()

    def rejected_for(self, reason: str) -> None:
        self.rejected.labels(self._shard, reason).inc()

    def refused_connection(self, socket: str, reason: str) -> None:
        self.connections_refused.labels(self._shard, socket, reason).inc()

    def sent_backup(self, how: str) -> None:
        self.backup_updates.labels(self._shard, how).inc()

    def straggler(self, rank: int) -> None:
        self.stragglers.labels(self._shard, str(rank)).inc()
        self.last_straggler.set(rank)

    # -- a consumer of the shard's updates (paramserver.shard.update.Consumer) --------------------------------------

    def logged(self, update: Update) -> None:
        """Nothing before an update applies."""

    def applied(self, update: Update) -> None:
        """Count what an update took: its apply time, the round's wait, the push's staleness, the straggler."""
        self.apply_seconds.observe(time.perf_counter() - update.started)
        self.version.set(update.version)
        if update.waited is not None:
            self.round_wait.observe(update.waited)
        if update.staleness is not None:
            self.staleness.observe(update.staleness)
        if update.straggler is not None:
            self.straggler(update.straggler)


def _process_metrics(r: CollectorRegistry, s: str) -> None:
    """The process's own figures: its memory limit and the standard process_* metrics."""
    # Read at each scrape: cheap, and a container's limit can be changed while it runs.
    Gauge(
        "paramserver_memory_limit_bytes",
        "Memory this shard's process may use: its cgroup's limit (the container's), else the machine's RAM",
        ["shard"],
        registry=r,
    ).labels(s).set_function(memory_limit)
    ProcessCollector(registry=r)  # process_resident_memory_bytes and the other process_* metrics


class MetricsServer:
    """/metrics over HTTP for one registry, stopped with the shard."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> None:
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = int(self._httpd.server_port)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
