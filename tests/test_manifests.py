"""The Kubernetes manifests (deploy/k8s): render every overlay with `kubectl kustomize` and check what the schemas
cannot: selectors and names that must agree, flags the commands accept, the shard topology, security settings.

No cluster: only kubectl's built-in kustomize. Skipped when kubectl (or PyYAML) is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML parses the rendered manifests (a dev dependency)")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
KUBECTL = shutil.which("kubectl") or ("/usr/bin/kubectl" if os.access("/usr/bin/kubectl", os.X_OK) else None)

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (it renders the overlays)")

SHARD = {"app.kubernetes.io/component": "shard"}
WORKER = {"app.kubernetes.io/component": "worker"}
IMAGE_UID = 10001
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


# -- rendering and lookups ---------------------------------------------------------------------------------------


@dataclass
class Rendered:
    """One rendered overlay: its documents, and lookups by kind, name and pod labels."""

    overlay: str
    docs: list[dict[str, Any]]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def named(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.all(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: expected one {kind} {name!r}, found {len(found)}"
        return found[0]

    def job(self, component: dict[str, str]) -> dict[str, Any]:
        found = [j for j in self.all("Job") if labels_match(component, pod_labels(j))]
        assert len(found) == 1, f"{self.overlay}: expected one Job for {component}, found {len(found)}"
        return found[0]

    def configmap_data(self, name: str) -> dict[str, str]:
        return self.named("ConfigMap", name).get("data", {})


@cache
def render(overlay: str) -> Rendered:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"kubectl kustomize overlays/{overlay} failed:\n{out.stderr}"
    return Rendered(overlay, [d for d in yaml.safe_load_all(out.stdout) if d])


@pytest.fixture(params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return render(request.param)


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def containers(workload: dict[str, Any], init: bool = True) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    return (spec.get("initContainers", []) if init else []) + spec["containers"]


def workloads(r: Rendered) -> list[dict[str, Any]]:
    kinds = ("Job", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Pod", "CronJob")
    return [d for d in r.docs if d["kind"] in kinds]


def labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels/matchExpressions, or a plain map) selects these labels."""
    match = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    if any(labels.get(k) != v for k, v in match.items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


# -- what a container runs ---------------------------------------------------------------------------------------


def parsers() -> dict[str, Callable[[], argparse.ArgumentParser]]:
    from paramserver.server.cli import build_parser as server_parser
    from worker.cli import build_parser as worker_parser

    return {"ps-server": server_parser, "ps-worker": worker_parser}


def option_strings(program: str) -> set[str]:
    return {s for a in parsers()[program]()._actions for s in a.option_strings}


def invocation(container: dict[str, Any]) -> tuple[str, list[str]]:
    """(program, its argv) of a container: `command + args`, seen through the shard's `sh -c SCRIPT PROGRAM`."""
    command, args = list(container.get("command", [])), list(container.get("args", []))
    assert command, f"container {container['name']} relies on the image's CMD; state the command"
    if command[:2] in (["/bin/sh", "-c"], ["sh", "-c"]):
        assert len(command) >= 4, f"container {container['name']}: sh -c SCRIPT needs the program as $0"
        return os.path.basename(command[3]), command[4:] + args
    return os.path.basename(command[0]), command[1:] + args


def env_values(r: Rendered, container: dict[str, Any], index: int = 0) -> dict[str, str]:
    """The container's environment as the kubelet builds it; the completion index is `index`."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        source = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = VAR.sub(lambda m: env.get(m.group(1), m.group(0)), e["value"])
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            data = r.configmap_data(ref["name"])
            assert ref["key"] in data or ref.get("optional"), f"{ref['name']} has no key {ref['key']!r}"
            env[e["name"]] = data.get(ref["key"], "")
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            env[e["name"]] = str(index) if path == COMPLETION_INDEX else f"<{path}>"
        else:  # secretKeyRef, resourceFieldRef
            env[e["name"]] = "dummy"
    return env


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """$(VAR) references, substituted as the kubelet does (an unknown one is left as it is)."""
    return [VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in argv]


def parse(program: str, argv: list[str]) -> argparse.Namespace:
    """Parse argv with the command's own parser and build its config dataclass (which validates the values)."""
    from paramserver.config import ServerConfig, from_arguments
    from worker.trainer import TrainConfig

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = parsers()[program]().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{program} refuses {argv}:\n{err.getvalue()}")
    try:
        from_arguments(ServerConfig if program == "ps-server" else TrainConfig, args)
    except ValueError as exc:
        pytest.fail(f"{program} {argv}: {exc}")
    return args


def resolved(r: Rendered, component: dict[str, str], index: int = 0) -> tuple[dict[str, Any], argparse.Namespace]:
    """The main container of a component's Job and its parsed command line, for completion index `index`."""
    job = r.job(component)
    container = containers(job, init=False)[0]
    program, argv = invocation(container)
    return container, parse(program, expand(argv, env_values(r, container, index)))


def ps_containers(r: Rendered) -> Iterator[tuple[dict[str, Any], dict[str, Any], str, list[str]]]:
    for w in workloads(r):
        for c in containers(w):
            program, argv = invocation(c)
            if program in ("ps-server", "ps-worker"):
                yield w, c, program, argv


def shard_names(r: Rendered) -> list[str]:
    job = r.job(SHARD)
    svc = pod_spec(job)["subdomain"]
    return [f"{job['metadata']['name']}-{i}.{svc}" for i in range(job["spec"]["completions"])]


def headless_service(r: Rendered) -> dict[str, Any]:
    found = [s for s in r.all("Service") if labels_match(s["spec"].get("selector", {}), pod_labels(r.job(SHARD)))]
    assert len(found) == 1, f"{r.overlay}: expected one Service selecting the shards, found {len(found)}"
    return found[0]


def port_of(container: dict[str, Any], port: int | str) -> dict[str, Any] | None:
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p
    return None


# -- the overlays ------------------------------------------------------------------------------------------------


def test_the_overlays_exist() -> None:
    assert {"cpu", "gpu"} <= set(OVERLAYS), OVERLAYS


def test_no_secret_is_committed(rendered: Rendered) -> None:
    assert not rendered.all("Secret"), "Secrets are referenced by the manifests, created in the cluster, never rendered"


# -- the shard topology ------------------------------------------------------------------------------------------


def test_shards_are_an_indexed_job_behind_a_headless_service(rendered: Rendered) -> None:
    job = rendered.job(SHARD)
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] >= 1, "one pod per shard, all running at once"
    svc = headless_service(rendered)
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"].get("publishNotReadyAddresses") is True, "a restoring shard must be resolvable"
    assert pod_spec(job)["subdomain"] == svc["metadata"]["name"]
    shard = containers(job, init=False)[0]
    for p in svc["spec"]["ports"]:
        target = port_of(shard, p.get("targetPort", p["port"]))
        assert target is not None, f"Service port {p['name']} targets {p.get('targetPort')}, not a shard port"
        assert target["containerPort"] == p["port"] and target["name"] == p["name"]


def test_peers_name_every_shard_in_order(rendered: Rendered) -> None:
    names = shard_names(rendered)
    shard = containers(rendered.job(SHARD), init=False)[0]
    grpc_port = port_of(shard, "grpc")
    assert grpc_port is not None
    for index in range(len(names)):
        _, args = resolved(rendered, SHARD, index)
        peers = [p.strip() for p in args.peers.split(",")]
        assert len(peers) == len(names), f"--peers lists {len(peers)} shards, the Job runs {len(names)}"
        for want, peer in zip(names, peers, strict=True):
            host, port = peer.rsplit(":", 1)
            assert host == want or host.startswith(want + "."), f"peer {peer!r} is not shard {want}"
            assert int(port) == grpc_port["containerPort"]
        assert args.shard_index == index, "--shard-index is the Job's completion index"
        assert args.host == "0.0.0.0"
        assert args.port in (None, grpc_port["containerPort"])


def test_workers_point_at_a_shard_and_match_the_job(rendered: Rendered) -> None:
    _, server = resolved(rendered, SHARD)
    _, worker = resolved(rendered, WORKER)
    host = worker.server.rsplit(":", 1)[0]
    assert any(host == n or host.startswith(n + ".") for n in shard_names(rendered)), worker.server
    assert worker.server in server.peers.split(",")
    job = rendered.job(WORKER)
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == server.workers, (
        "the worker Job runs exactly the workers the shards wait for"
    )
    assert worker.job_name == server.job_name
    assert worker.progress is False, "no progress bar in pod logs"


def test_the_init_container_waits_for_the_workers_shard(rendered: Rendered) -> None:
    job = rendered.job(WORKER)
    _, worker = resolved(rendered, WORKER)
    for init in pod_spec(job).get("initContainers", []):
        program, argv = invocation(init)
        assert program not in parsers()
        if program.startswith("python") and argv[:1] == ["-c"]:
            compile(argv[1], f"{init['name']} (python -c)", "exec")
        assert env_values(rendered, init).get("PS_SERVER") == worker.server


# -- commands, flags and configuration ---------------------------------------------------------------------------


def test_every_command_line_is_accepted(rendered: Rendered) -> None:
    seen = set()
    for _, c, program, argv in ps_containers(rendered):
        args = expand(argv, env_values(rendered, c))
        unresolved = [a for a in args if VAR.search(a)]
        assert not unresolved, f"{c['name']}: $(VAR) references without an env var: {unresolved}"
        parse(program, args)
        seen.add(program)
    assert seen == {"ps-server", "ps-worker"}


def test_configmap_keys_are_flags_of_the_commands_that_read_them(rendered: Rendered) -> None:
    read: dict[str, set[str]] = {}
    for _, c, program, argv in ps_containers(rendered):
        options = option_strings(program)
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("configMapKeyRef")
            if not ref:
                continue
            flag = "--" + ref["key"]
            assert flag in options, f"{ref['name']} key {ref['key']!r} is not a {program} flag"
            assert f"{flag}=$({e['name']})" in argv, f"{c['name']}: {e['name']} is read but not passed as {flag}"
            read.setdefault(ref["name"], set()).add(ref["key"])
    assert read, "the configuration reaches the containers through ConfigMaps"
    for cm in rendered.all("ConfigMap"):
        unread = set(cm.get("data", {})) - read.get(cm["metadata"]["name"], set())
        assert not unread, f"ConfigMap {cm['metadata']['name']}: keys no command reads: {sorted(unread)}"


def test_the_server_configmap_holds_only_ps_server_flags(rendered: Rendered) -> None:
    shard = containers(rendered.job(SHARD), init=False)[0]
    names = {
        e["valueFrom"]["configMapKeyRef"]["name"] for e in shard["env"] if "configMapKeyRef" in e.get("valueFrom", {})
    }
    options = option_strings("ps-server")
    for name in names:
        for key in rendered.configmap_data(name):
            assert "--" + key in options, f"ConfigMap {name}: {key!r} is not a ps-server flag"


def test_one_image_for_shards_and_workers(rendered: Rendered) -> None:
    images = {c["image"] for w in workloads(rendered) for c in containers(w)}
    assert len(images) == 1, images


# -- ending cleanly ----------------------------------------------------------------------------------------------


def test_jobs_end_when_training_is_done(rendered: Rendered) -> None:
    for component in (SHARD, WORKER):
        job = rendered.job(component)
        spec, pod = job["spec"], pod_spec(job)
        assert pod["restartPolicy"] in ("Never", "OnFailure")
        if "podFailurePolicy" in spec:
            assert pod["restartPolicy"] == "Never", "a podFailurePolicy needs restartPolicy Never"
            names = {r.get("onExitCodes", {}).get("containerName") for r in spec["podFailurePolicy"]["rules"]}
            assert names - {None} <= {c["name"] for c in containers(job)}
        assert spec.get("ttlSecondsAfterFinished") is not None
    _, server = resolved(rendered, SHARD)
    assert server.exit_when_done is True, "shards must exit 0 once every worker finished"
    assert not [d for d in rendered.docs if d["kind"] in ("StatefulSet", "Deployment")], "those restart forever"


def _wrapper(rendered: Rendered) -> str:
    shard = containers(rendered.job(SHARD), init=False)[0]
    command = shard["command"]
    assert command[:2] == ["/bin/sh", "-c"] and command[3] == "ps-server"
    return command[2]


@pytest.mark.skipif(not os.path.exists("/bin/sh"), reason="needs /bin/sh")
@pytest.mark.parametrize(
    ("behaviour", "status"),
    [("done", 0), ("fail", 2), ("crash", 1), ("term", 143)],
)
def test_the_shard_wrapper_turns_a_stop_into_a_failure(tmp_path: Path, behaviour: str, status: int) -> None:
    """Exit 0 by itself (job done) stays 0; exit 0 after SIGTERM becomes 143, so the Job replaces the shard."""
    script = _wrapper(render("cpu"))
    fake = tmp_path / "ps-server"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import pathlib, signal, sys, time\n"
        "mode, marker = sys.argv[1], pathlib.Path(sys.argv[2])\n"
        "if mode != 'term':\n"
        "    sys.exit({'done': 0, 'fail': 2, 'crash': 1}[mode])\n"
        "def stop(*_):\n"
        "    marker.write_text('final checkpoint')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    time.sleep(0.05)\n"
    )
    fake.chmod(0o755)
    marker = tmp_path / "stopped"
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(
        ["/bin/sh", "-c", script, "ps-server", behaviour, str(marker)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        if behaviour == "term":
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == status
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert marker.exists() == (behaviour == "term"), "the stopped shard ran its own shutdown (final checkpoint)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(not os.path.exists("/bin/sh"), reason="needs /bin/sh")
def test_the_shard_wrapper_with_the_real_ps_server(tmp_path: Path) -> None:
    """The real ps-server under the wrapper: SIGTERM -> its clean stop (exit 0) -> the pod's exit status 143."""
    bindir = Path(sys.executable).parent
    if not (bindir / "ps-server").exists():
        pytest.skip("ps-server is not installed next to this Python")
    port = _free_port()
    argv = ["--shard-index=0", f"--peers=127.0.0.1:{port}", "--host=127.0.0.1", f"--checkpoint-dir={tmp_path}"]
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(
        ["/bin/sh", "-c", _wrapper(render("cpu")), "ps-server", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        from paramserver.server.cluster import READY_LINE

        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(READY_LINE):
                break
        else:
            pytest.fail(f"ps-server did not start: {proc.stderr.read() if proc.stderr else ''}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert proc.stderr is not None and "stopped at version" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- probes, ports, metrics --------------------------------------------------------------------------------------


def test_probes_use_ports_of_their_container(rendered: Rendered) -> None:
    for w in workloads(rendered):
        for c in containers(w):
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if not probe:
                    continue
                for handler in ("grpc", "tcpSocket", "httpGet"):
                    if handler in probe:
                        port = probe[handler]["port"]
                        assert port_of(c, port), f"{c['name']} {kind} uses port {port}, not one of its ports"


def test_shard_probes_check_grpc_health(rendered: Rendered) -> None:
    from paramserver.server.shard_server import SERVICE_NAME

    shard = containers(rendered.job(SHARD), init=False)[0]
    _, args = resolved(rendered, SHARD)
    for kind in ("readinessProbe", "livenessProbe"):
        probe = shard.get(kind)
        assert probe, f"the shard has no {kind}"
        if args.tls_cert:
            # The kubelet's gRPC probes speak plaintext only; they would fail against a TLS port.
            assert "grpc" not in probe, f"{kind}: native gRPC probes cannot do TLS"
        else:
            assert probe["grpc"]["port"] == port_of(shard, "grpc")["containerPort"]  # type: ignore[index]
            assert probe["grpc"].get("service", "") in ("", SERVICE_NAME)


def test_metrics_are_exposed_and_scrapable(rendered: Rendered) -> None:
    job = rendered.job(SHARD)
    shard = containers(job, init=False)[0]
    _, args = resolved(rendered, SHARD)
    metrics = port_of(shard, "metrics")
    assert metrics is not None and args.metrics_port == metrics["containerPort"]
    annotations = job["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true"
    # The annotated port is the one ps-server serves its metrics on (--metrics-port), by number.
    assert annotations.get("prometheus.io/port") == str(args.metrics_port), "annotation port != --metrics-port"
    assert annotations.get("prometheus.io/path") == "/metrics"
    # The headless Service publishes it too, by name, for a ServiceMonitor (components/servicemonitor).
    ports = {p["name"]: p for p in headless_service(rendered)["spec"]["ports"]}
    assert ports["metrics"]["targetPort"] in ("metrics", args.metrics_port)


def render_with_component(overlay: str, component: str, tmp_path: Path) -> Rendered:
    """Render an overlay with one more component, as an overlay of its own would (kustomize wants relative paths)."""
    assert KUBECTL is not None
    here = tmp_path / "overlay"
    here.mkdir()
    base, extra = (os.path.relpath(p, here) for p in (K8S / "overlays" / overlay, K8S / "components" / component))
    (here / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: paramserver\n"
        f"resources: [{base}]\ncomponents: [{extra}]\n"
    )
    out = subprocess.run([KUBECTL, "kustomize", str(here)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {overlay} + components/{component} failed:\n{out.stderr}"
    return Rendered(f"{overlay}+{component}", [d for d in yaml.safe_load_all(out.stdout) if d])


def test_the_servicemonitor_component_scrapes_every_shard(tmp_path: Path) -> None:
    r = render_with_component("cpu", "servicemonitor", tmp_path)
    (monitor,) = r.all("ServiceMonitor")
    service = headless_service(r)
    assert monitor["metadata"].get("namespace") == service["metadata"]["namespace"]
    assert labels_match(monitor["spec"]["selector"], service["metadata"]["labels"]), "it selects the headless Service"
    others = [s for s in r.all("Service") if s is not service]
    assert not any(labels_match(monitor["spec"]["selector"], s["metadata"].get("labels", {})) for s in others)
    (endpoint,) = monitor["spec"]["endpoints"]
    port = {p["name"]: p for p in service["spec"]["ports"]}[endpoint["port"]]
    _, args = resolved(r, SHARD)
    container = containers(r.job(SHARD), init=False)[0]
    target = port_of(container, port["targetPort"])
    assert target is not None and target["containerPort"] == args.metrics_port, "it scrapes --metrics-port"
    annotations = r.job(SHARD)["spec"]["template"]["metadata"]["annotations"]
    assert endpoint.get("path", "/metrics") == annotations["prometheus.io/path"]
    # The job label comes from a label of the Service, and is the job the alert rules select.
    job = service["metadata"]["labels"][monitor["spec"]["jobLabel"]]
    alerts = (ROOT / "deploy" / "monitoring" / "alerts.yml").read_text()
    assert f'job="{job}"' in alerts
    # The shards' NetworkPolicy admits the scrapes on that port.
    policy = r.named("NetworkPolicy", "paramserver-shard")
    assert any(args.metrics_port in {p["port"] for p in rule.get("ports", [])} for rule in policy["spec"]["ingress"])


# -- network policy, disruption budget ---------------------------------------------------------------------------


def test_only_workers_reach_the_shards_grpc_and_data_ports(rendered: Rendered) -> None:
    shard_labels, worker_labels = pod_labels(rendered.job(SHARD)), pod_labels(rendered.job(WORKER))
    policies = [p for p in rendered.all("NetworkPolicy") if labels_match(p["spec"]["podSelector"], shard_labels)]
    assert len(policies) == 1, "one NetworkPolicy selects the shards"
    spec = policies[0]["spec"]
    assert "Ingress" in spec["policyTypes"]
    grpc = port_of(containers(rendered.job(SHARD), init=False)[0], "grpc")["containerPort"]  # type: ignore[index]
    metrics = port_of(containers(rendered.job(SHARD), init=False)[0], "metrics")["containerPort"]  # type: ignore[index]
    data = port_of(containers(rendered.job(SHARD), init=False)[0], "data")["containerPort"]  # type: ignore[index]
    _, args = resolved(rendered, SHARD)
    assert args.data_port == data, "the shard serves its data socket on the port the pod declares"
    admitted = {grpc: False, data: False, metrics: False}
    for rule in spec.get("ingress", []):
        ports = {p["port"] for p in rule.get("ports", [])}
        assert ports, "every ingress rule names its ports"
        peers = rule.get("from", [])
        assert peers, "no rule admits everyone"
        assert grpc not in ports or data in ports, "a worker that reaches the gRPC port must reach the data socket"
        for port in (grpc, data):
            if port in ports:
                for peer in peers:
                    assert set(peer) == {"podSelector"}, f"port {port} admits pods of this namespace only"
                    assert labels_match(peer["podSelector"], worker_labels), f"port {port} admits worker pods only"
                    assert not labels_match(peer["podSelector"], shard_labels)
                admitted[port] = True
        if metrics in ports:
            admitted[metrics] = True
    assert all(admitted.values()), f"ports admitted: {admitted}"


def test_the_disruption_budget_covers_every_shard(rendered: Rendered) -> None:
    job = rendered.job(SHARD)
    pdbs = [p for p in rendered.all("PodDisruptionBudget") if labels_match(p["spec"]["selector"], pod_labels(job))]
    assert len(pdbs) == 1
    spec = pdbs[0]["spec"]
    assert not labels_match(spec["selector"], pod_labels(rendered.job(WORKER)))
    # Pods of a Job (no scale subresource) support only an integer minAvailable.
    assert "maxUnavailable" not in spec and isinstance(spec["minAvailable"], int)
    assert spec["minAvailable"] == job["spec"]["completions"]


# -- security, resources, storage --------------------------------------------------------------------------------


def test_pods_run_unprivileged_on_a_read_only_root(rendered: Rendered) -> None:
    for w in workloads(rendered):
        pod = pod_spec(w)
        assert pod.get("automountServiceAccountToken") is False
        psc = pod.get("securityContext", {})
        assert psc.get("runAsNonRoot") is True and psc.get("runAsUser") == IMAGE_UID
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault"
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in containers(w):
            sc = c.get("securityContext", {})
            assert sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, c["name"]
            assert sc.get("runAsUser", psc.get("runAsUser")) == IMAGE_UID, c["name"]
            assert sc.get("readOnlyRootFilesystem") is True, c["name"]
            assert sc.get("allowPrivilegeEscalation") is False, c["name"]
            assert sc.get("privileged", False) is False, c["name"]
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), c["name"]
            assert not sc.get("capabilities", {}).get("add"), c["name"]
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{c['name']} mounts the missing volume {m['name']}"
        for c in containers(w, init=False):
            tmp = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in volumes[tmp[0]["name"]], f"{c['name']}: /tmp must be a writable emptyDir"


def _quantity(value: Any) -> float:
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    text = str(value)
    for unit, factor in sorted(units.items(), key=lambda u: -len(u[0])):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return float(text)


def test_every_container_has_requests_and_limits(rendered: Rendered) -> None:
    for w in workloads(rendered):
        for c in containers(w):
            res = c.get("resources", {})
            for resource in ("cpu", "memory"):
                request, limit = res.get("requests", {}).get(resource), res.get("limits", {}).get(resource)
                assert request is not None and limit is not None, f"{c['name']}: {resource} request and limit"
                assert _quantity(request) <= _quantity(limit), f"{c['name']}: {resource} request above the limit"


def test_gpus_only_where_the_overlay_asks(rendered: Rendered) -> None:
    gpu = "nvidia.com/gpu"
    _, worker = resolved(rendered, WORKER)
    for w in workloads(rendered):
        for c in containers(w):
            res = c.get("resources", {})
            wants = res.get("limits", {}).get(gpu)
            is_worker = labels_match(WORKER, pod_labels(w)) and c in containers(w, init=False)
            if rendered.overlay == "gpu" and is_worker:
                assert wants is not None and int(wants) >= 1, "GPU workers request nvidia.com/gpu"
                assert res.get("requests", {}).get(gpu, wants) == wants, "GPU requests must equal limits"
            else:
                assert wants is None, f"{rendered.overlay}: {c['name']} requests a GPU"
    job = pod_spec(rendered.job(WORKER))
    if rendered.overlay == "gpu":
        assert worker.device.startswith("cuda")
        assert job.get("nodeSelector") or job.get("affinity"), "GPU workers are placed on GPU nodes"
        assert any(t.get("key") == gpu for t in job.get("tolerations", []))
    else:
        assert not worker.device.startswith("cuda")


def test_checkpoints_and_results_land_on_the_shared_volume(rendered: Rendered) -> None:
    def volume_under(w: dict[str, Any], c: dict[str, Any], path: str) -> dict[str, Any]:
        volumes = {v["name"]: v for v in pod_spec(w).get("volumes", [])}
        mounts = [m for m in c.get("volumeMounts", []) if (path + "/").startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounts, f"{c['name']}: {path} is on no volume (the root filesystem is read-only)"
        mount = max(mounts, key=lambda m: len(m["mountPath"]))
        return {"readOnly": mount.get("readOnly", False), **volumes[mount["name"]]}

    shard, server = resolved(rendered, SHARD)
    volume = volume_under(rendered.job(SHARD), shard, server.checkpoint_dir)
    assert not volume["readOnly"]
    claim = rendered.named("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert "ReadWriteMany" in claim["spec"]["accessModes"], "shards on different nodes share the checkpoint directory"
    worker_container, worker = resolved(rendered, WORKER)
    for path in (worker.metrics_out, worker.save_model):
        if path:
            assert not volume_under(rendered.job(WORKER), worker_container, path)["readOnly"]
    for (c, args), w in (((shard, server), rendered.job(SHARD)), ((worker_container, worker), rendered.job(WORKER))):
        for path in (args.tls_cert, args.tls_key, args.tls_ca, args.auth_token_file):
            if path:
                assert "secret" in volume_under(w, c, os.path.dirname(path)), f"{path} comes from a Secret"
