"""Monitoring (deploy/monitoring): what Prometheus, Grafana and the alert rules see of a job.

- The Grafana dashboard's and the alert rules' expressions name only metrics (and labels) that a live shard exports
  (a thread cluster with a metrics port, its /metrics parsed with prometheus_client's parser). Cheap: runs always.
- `promtool check rules` and `promtool test rules` on the rules (skipped where promtool is not installed).
- A real Prometheus scrapes a live 2-shard job (shard processes) once a second while two workers train in sync
  mode, one of them slowed before each push; its HTTP API must then report what happened: the pushes made, each
  shard's version, the live workers, the straggler's rank, a refused worker; after the workers leave, no live
  worker; after a shard is killed, `up == 0` and the ParamserverShardDown alert pending. Runs only when asked
  (Debian's `prometheus` package; `make monitoring-test` installs it):

      PS_MONITORING=1 .venv/bin/python -m pytest tests/test_monitoring.py -v -s

Every query and the value Prometheus answered are printed (-s).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from paramserver import LocalCluster, ServerConfig
from paramserver.errors import WrongJob
from paramserver.metrics import cgroup_memory_limit, memory_limit
from worker import PSClient

yaml = pytest.importorskip("yaml", reason="PyYAML reads the alert rules (a dev dependency)")

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "deploy" / "monitoring"
ALERTS = MONITORING / "alerts.yml"
ALERTS_TEST = MONITORING / "alerts.test.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
JOB = "paramserver"  # the scrape job's name, which the alert rules select

# Series that Prometheus makes itself, not a shard: the scrape's health and the alerts' state.
SYNTHETIC = {"up": {"job", "instance"}, "ALERTS": {"alertname", "alertstate", "severity"}}
# Labels that every scraped series gets from its target.
TARGET_LABELS = {"job", "instance"}

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (apt-get install prometheus)")


def live(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test that needs a real Prometheus: it runs only with PS_MONITORING=1 (make monitoring-test)."""
    for mark in (
        pytest.mark.monitoring,
        pytest.mark.skipif(os.environ.get("PS_MONITORING") != "1", reason="runs with PS_MONITORING=1"),
        pytest.mark.skipif(PROMETHEUS is None, reason="needs prometheus (make monitoring-test installs it)"),
    ):
        test = mark(test)
    return test


# -- PromQL, enough of it to name what an expression reads ------------------------------------------------------

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
_IDENT = re.compile(r"(?<![\w.$:])([A-Za-z_:][A-Za-z0-9_:]*+)(?!\s*\()")


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) that a PromQL expression reads. Template variables ($job, ${x},
    $__rate_interval) are ignored; functions are identifiers followed by '('."""
    labels = {m for body in _MATCHERS.findall(expr) for m in _MATCHER.findall(body)}
    labels |= {name.strip() for _, body in _GROUPING.findall(expr) for name in body.split(",") if name.strip()}
    rest = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (matcher values)
    rest = _MATCHERS.sub(" ", rest)
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # range and subquery durations
    rest = _GROUPING.sub(" ", rest)
    rest = re.sub(r"\$\{?\w+\}?", " ", rest)
    metrics = {m for m in _IDENT.findall(rest) if m not in _KEYWORDS and m.lower() not in ("inf", "nan")}
    return metrics, labels


def test_promql_names_reads_metrics_and_labels() -> None:
    assert promql_names('up{job="$job"} == 0') == ({"up"}, {"job"})
    expr = (
        'histogram_quantile(0.9, sum by (shard, le) (rate(paramserver_apply_seconds_bucket{job="a", shard=~"$s"}'
        "[$__rate_interval]))) > 1e9 and on (job) group_left (shard) paramserver_version offset 5m"
    )
    assert promql_names(expr) == (
        {"paramserver_apply_seconds_bucket", "paramserver_version"},
        {"job", "shard", "le"},
    )
    assert promql_names("count(ALERTS) or vector(0)")[0] == {"ALERTS"}


# -- the names a live shard exports -----------------------------------------------------------------------------

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}


def exported(texts: list[str]) -> dict[str, set[str]]:
    """Every series name the /metrics texts expose (a labelled family without samples yet counts too), with
    the label names seen on it."""
    names: dict[str, set[str]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for suffix in _SUFFIXES.get(family.type, ("",)):
                names.setdefault(family.name + suffix, set())
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return names


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _train(client: PSClient, model: torch.nn.Module, steps: int, delay: float = 0.0) -> None:
    """Train `steps` sync steps on random data, sleeping `delay` seconds before each push."""
    gen = torch.Generator().manual_seed(client.rank)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 2, (16,), generator=gen)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if delay:
            time.sleep(delay)
        client.push_pull(model)


def _train_together(clients: list[PSClient], models: list[torch.nn.Module], steps: int, delays: list[float]) -> None:
    """Every client trains in a thread of its own (a sync round needs them all); re-raise the first error."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            _train(clients[i], models[i], steps, delays[i])
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"worker-{i}") for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "training did not finish within 300 s"
    if errors:
        raise errors[0]


def _dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    panels += [p for row in dashboard["panels"] if row["type"] == "row" for p in row.get("panels", [])]
    return [(f"panel {p['title']!r}", t["expr"]) for p in panels for t in p.get("targets", [])]


def _alert_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [(f"rule {r.get('alert') or r.get('record')}", r["expr"]) for g in rules["groups"] for r in g["rules"]]


def test_the_dashboard_covers_what_a_shard_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    for want in ("Version", "Pushes/s by result", "Pulls/s", "Bytes/s", "Apply latency", "Round wait (sync)"):
        assert want in titles
    for want in ("Staleness (async, ssp)", "Live workers", "Rejections/s by reason", "Evictions", "Memory"):
        assert want in titles
    assert {"Straggler rounds by rank", "Last straggler rank"} <= titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "shard"} <= variables
    for _, expr in _dashboard_exprs():
        assert "$job" in expr, f"every query selects the dashboard's job: {expr}"


def test_dashboard_and_alerts_read_only_metrics_a_live_shard_exports(ps_cluster_factory) -> None:
    config = ServerConfig(mode="sync", workers=2, optimizer="sgd", lr=0.1, metrics_port=0)
    cluster = ps_cluster_factory(config, shards=2)
    ports = [s.metrics_port for s in cluster.servers]
    assert all(ports)
    # Traffic, so that the labelled families (pushes by result, rejections by reason, stragglers by rank) have
    # samples whose labels can be checked too.
    clients = [PSClient(cluster.address), PSClient(cluster.address)]
    try:
        models = [_model(), _model()]
        for c, m in zip(clients, models, strict=True):
            c.register(m)
        _train_together(clients, models, steps=2, delays=[0.0, 0.05])
        with pytest.raises(WrongJob):
            PSClient(cluster.address, job_name="another-job", connect_timeout=10)
        names = exported([_scrape(p) for p in ports])
    finally:
        for c in clients:
            c.close()
    assert "process_resident_memory_bytes" in names and "paramserver_memory_limit_bytes" in names
    for name in ("paramserver_pushes_total", "paramserver_rejected_total", "paramserver_straggler_rounds_total"):
        assert names[name], f"{name} has samples"
    checked = 0
    for where, expr in _dashboard_exprs() + _alert_exprs():
        metrics, labels = promql_names(expr)
        assert metrics, f"{where}: no metric in {expr!r}"
        for metric in metrics:
            assert metric in names or metric in SYNTHETIC, f"{where}: a shard exports no {metric!r}"
        known = set(TARGET_LABELS)
        for metric in metrics:
            known |= names.get(metric, set()) | SYNTHETIC.get(metric, set())
        assert labels <= known, f"{where}: labels {sorted(labels - known)} are on none of {sorted(metrics)}"
        checked += 1
    print(f"\n{checked} expressions (dashboard and alert rules) read only metrics and labels a live shard exports")


def test_memory_limit_is_the_tightest_cgroup_limit(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    # cgroup v2, the pod's limit on an ancestor of the container's cgroup (which sets none)
    (root / "kubepods" / "pod1" / "ctr").mkdir(parents=True)
    (root / "kubepods" / "pod1" / "memory.max").write_text("4294967296\n")
    (root / "kubepods" / "pod1" / "ctr" / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup-of-self"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    assert cgroup_memory_limit(root, proc) == 4 << 30
    # cgroup v1: "no limit" is a huge number; a limit on the container's own directory
    v1 = tmp_path / "v1"
    (v1 / "memory" / "docker" / "abc").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text("2147483648\n")
    proc.write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n")
    assert cgroup_memory_limit(v1, proc) == 2 << 30
    proc.write_text("4:memory:/docker/abc\n")
    (v1 / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_memory_limit(v1, proc) == 0  # no limit anywhere
    # A container that sees its own cgroup mounted as the root while /proc/self/cgroup names the host's path
    proc.write_text("4:memory:/kubepods/burstable/pod2/ctr\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text("1073741824\n")
    assert cgroup_memory_limit(v1, proc) == 1 << 30
    assert cgroup_memory_limit(v1, tmp_path / "missing") == 0
    assert memory_limit() > 0


# -- promtool -------------------------------------------------------------------------------------------------------


def _promtool(*args: str) -> str:
    assert PROMTOOL is not None
    out = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=MONITORING)
    print(out.stdout + out.stderr)
    assert out.returncode == 0, f"promtool {' '.join(args)} failed:\n{out.stdout}{out.stderr}"
    return out.stdout


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    assert "SUCCESS" in _promtool("check", "rules", ALERTS.name)


@needs_promtool
def test_promtool_unit_tests_the_rules() -> None:
    assert "SUCCESS" in _promtool("test", "rules", ALERTS_TEST.name)
    tested = {
        t["alertname"] for case in yaml.safe_load(ALERTS_TEST.read_text())["tests"] for t in case["alert_rule_test"]
    }
    alerts = {name.removeprefix("rule ") for name, _ in _alert_exprs()}
    assert alerts <= tested, f"alerts without a unit test: {sorted(alerts - tested)}"


# -- a real Prometheus over a live job --------------------------------------------------------------------------


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _free_ports(n: int) -> int:
    """A port p such that p .. p+n-1 are all free now (the shards' metrics ports: base + index)."""
    for _ in range(100):
        base = _free_port("0.0.0.0")
        held = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"found no {n} consecutive free ports")


class Prometheus:
    """A `prometheus` process on 127.0.0.1 and queries to its HTTP API."""

    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> dict[tuple[tuple[str, str], ...], float]:
        """An instant query's vector as {labels: value}, labels sorted, without __name__."""
        data = self.api("query", query=promql)
        assert data["resultType"] == "vector", data
        return {
            tuple(sorted((k, v) for k, v in r["metric"].items() if k != "__name__")): float(r["value"][1])
            for r in data["result"]
        }

    def until(
        self, promql: str, check: Callable[[dict[tuple[tuple[str, str], ...], float]], bool], timeout: float = 180
    ) -> dict[tuple[tuple[str, str], ...], float]:
        """Poll the query until `check` holds for its answer (scrapes lag the events); print it; return it."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self.query(promql)
            except OSError as exc:  # a loaded machine: Prometheus is slow to answer
                got, error = {}, exc
            else:
                error = None
                if check(got):
                    print(f"PromQL  {promql}\n   =>  {_show(got)}")
                    return got
            if time.monotonic() > deadline:
                raise AssertionError(f"after {timeout:.0f} s, {promql} gives {_show(got)} {error or ''}")
            time.sleep(0.5)

    def equals(self, promql: str, want: dict[str, float], key: str | tuple[str, ...] = "shard") -> None:
        """Poll until the query gives exactly `want`, keyed by the value of one label (or a tuple of labels)."""
        keys = (key,) if isinstance(key, str) else key

        def by_key(got: dict[tuple[tuple[str, str], ...], float]) -> dict[str, float]:
            return {"/".join(dict(labels).get(k, "") for k in keys): v for labels, v in got.items()}

        self.until(promql, lambda got: by_key(got) == want)


def _show(got: dict[tuple[tuple[str, str], ...], float]) -> str:
    if not got:
        return "(empty)"
    return ", ".join(
        f"{{{', '.join(f'{k}={v!r}' for k, v in labels if k not in ('job',))}}} {value:g}"
        for labels, value in sorted(got.items())
    )


def _stop(proc: subprocess.Popen[Any], timeout: float = 20) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def metrics_port() -> int:
    return _free_ports(2)


@pytest.fixture
def live_job(metrics_port: int) -> Iterator[LocalCluster]:
    """Two shard processes in sync mode for two workers, metrics on metrics_port and metrics_port + 1."""
    # A long lease: the workers stay live while the test waits for scrapes, even on a loaded machine.
    config = ServerConfig(
        mode="sync", workers=2, optimizer="sgd", lr=0.05, lease_timeout=120.0, metrics_port=metrics_port
    )
    cluster = LocalCluster(config, shards=2, processes=True, start_timeout=120)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def prometheus(tmp_path: Path, metrics_port: int) -> Iterator[Prometheus]:
    """The real `prometheus`, scraping both shards every second and evaluating deploy/monitoring/alerts.yml."""
    assert PROMETHEUS is not None
    port = _free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {
                "job_name": JOB,
                "static_configs": [{"targets": [f"127.0.0.1:{metrics_port + i}" for i in range(2)]}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"prometheus exited with {proc.returncode}:\n{log.read_text()}"
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready within 120 s:\n{log.read_text()}"
            time.sleep(0.3)
        print(f"\nprometheus {url} scraping 127.0.0.1:{metrics_port} and :{metrics_port + 1} every second")
        yield Prometheus(url, proc, log)
    finally:
        _stop(proc)
        text = "\n".join(line for line in log.read_text(errors="replace").splitlines() if "SIGTERM" not in line)
        if text:
            print(f"prometheus log (warnings and errors):\n{text[-4000:]}")


STEPS = 25
SLOW_S = 0.3  # the straggler's pause before each push: far longer than a step of this model (about 1 ms)


@live
@pytest.mark.timeout(900)
def test_prometheus_records_what_the_job_did(live_job: LocalCluster, prometheus: Prometheus) -> None:
    prom, sel = prometheus, f'job="{JOB}"'
    prom.until(f"up{{{sel}}}", lambda got: len(got) == 2 and all(v == 1 for v in got.values()))
    rules = prom.api("rules")["groups"]
    loaded = {r["name"]: r["health"] for g in rules for r in g["rules"]}
    assert len(loaded) == len(_alert_exprs()), loaded
    prom.until(f"paramserver_live_workers{{{sel}}}", lambda got: len(got) == 2 and set(got.values()) == {0.0})

    clients: list[PSClient] = []
    try:
        clients = [PSClient(live_job.address), PSClient(live_job.address)]
        fast, slow = clients
        assert (fast.rank, slow.rank) == (0, 1)
        models = [_model(), _model()]
        for c, m in zip(clients, models, strict=True):
            c.register(m)
        prom.equals(f"paramserver_live_workers{{{sel}}}", {"0": 2, "1": 2})
        _train_together(clients, models, STEPS, delays=[0.0, SLOW_S])
        assert fast.versions == slow.versions == [STEPS, STEPS]
        # A worker of another job is refused by shard 0 (it joins there first) and counted.
        with pytest.raises(WrongJob):
            PSClient(live_job.address, job_name="another-job", connect_timeout=30)

        # Each step pushes one gradient to each shard: workers x shards x steps in all, workers x steps per shard.
        pushes = len(clients) * 2 * STEPS
        prom.until(
            f'sum(paramserver_pushes_total{{{sel}, result="applied"}})', lambda got: list(got.values()) == [pushes]
        )
        prom.equals(
            f'sum by (shard) (paramserver_pushes_total{{{sel}, result="applied"}})', {"0": pushes / 2, "1": pushes / 2}
        )
        prom.equals(f"paramserver_version{{{sel}}}", {str(k): v for k, v in enumerate(fast.versions)})
        prom.equals(f"paramserver_live_workers{{{sel}}}", {"0": 2, "1": 2})
        prom.equals(f"paramserver_round_wait_seconds_count{{{sel}}}", {"0": STEPS, "1": STEPS})
        prom.equals(f"paramserver_apply_seconds_count{{{sel}}}", {"0": STEPS, "1": STEPS})
        prom.equals(f'paramserver_rejected_total{{{sel}, reason="WrongJob"}}', {"0": 1})
        # Every round has a last worker; the slowed one is it in (nearly) every round, and in the last one.
        prom.equals(f"sum by (shard) (paramserver_straggler_rounds_total{{{sel}}})", {"0": STEPS, "1": STEPS})
        prom.equals(f"paramserver_last_straggler_rank{{{sel}}}", {"0": slow.rank, "1": slow.rank})
        prom.until(
            f'paramserver_straggler_rounds_total{{{sel}, rank="{slow.rank}"}}',
            lambda got: len(got) == 2 and all(v >= 0.8 * STEPS for v in got.values()),
        )
        # What Prometheus holds is what the shards' own /metrics say now, series by series.
        ports = [live_job.config.metrics_port + i for i in range(2)]  # type: ignore[operator]
        for name in (
            "paramserver_straggler_rounds_total",
            "paramserver_pulls_total",
            "paramserver_received_bytes_total",
            "paramserver_sent_bytes_total",
        ):
            direct = {}
            for port in ports:
                direct.update(samples(_scrape(port), name))
            prom.equals(f"{name}{{{sel}}}", direct, key=("shard", "rank"))
        prom.until(
            f"process_resident_memory_bytes{{{sel}}} / on (job, instance) group_right "
            f"paramserver_memory_limit_bytes{{{sel}}}",
            lambda got: len(got) == 2 and all(0 < v < 1 for v in got.values()),
        )
    finally:
        for c in clients:
            c.close()
    # The workers left: no live worker anywhere.
    prom.equals(f"paramserver_live_workers{{{sel}}}", {"0": 0, "1": 0})

    # Every rule evaluates without error against the real series.
    health = {r["name"]: (r["health"], r.get("lastError", "")) for g in prom.api("rules")["groups"] for r in g["rules"]}
    print(f"rules: {health}")
    assert all(h == "ok" for h, _ in health.values()), health

    # A shard dies: its target goes down, and the shard-down alert is pending (it fires after its `for`).
    live_job.kill(1)
    live_job.procs[1].wait(timeout=30)
    down = f"127.0.0.1:{live_job.config.metrics_port + 1}"  # type: ignore[operator]
    prom.until(f"up{{{sel}}} == 0", lambda got: [dict(k)["instance"] for k in got] == [down])
    prom.until(
        'ALERTS{alertname="ParamserverShardDown"}',
        lambda got: [(dict(k)["instance"], dict(k)["alertstate"]) for k in got] == [(down, "pending")],
    )


def samples(text: str, name: str) -> dict[str, float]:
    """A /metrics text's samples of one series name, keyed like Prometheus.equals(key=("shard", "rank"))."""
    return {
        f"{sample.labels.get('shard', '')}/{sample.labels.get('rank', '')}": float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }
