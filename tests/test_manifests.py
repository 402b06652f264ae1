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
import urllib.parse
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
SERVING = {"app.kubernetes.io/component": "serving"}
COORDINATOR = {"app.kubernetes.io/component": "coordinator"}
IMAGE_UID = 10001
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# Labels the Job controller sets on an Indexed Job's pods (not in the pod template).
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
ETCD_IMAGE = re.compile(r"^quay\.io/coreos/etcd:v3\.5\.\d+$")
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

    def jobs(self, component: dict[str, str]) -> list[dict[str, Any]]:
        return [j for j in self.all("Job") if labels_match(component, pod_labels(j))]

    def job(self, component: dict[str, str]) -> dict[str, Any]:
        """The one Job of a component (the shards: the Job of replica 0, see shard_jobs)."""
        if component == SHARD:
            return shard_jobs(self)[0]
        found = self.jobs(component)
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
    from paramserver.serving.cli import build_parser as serving_parser
    from worker.cli import build_parser as worker_parser

    return {"ps-server": server_parser, "ps-worker": worker_parser, "ps-serve": serving_parser}


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


def env_values(
    r: Rendered, container: dict[str, Any], index: int = 0, fields: dict[str, str] | None = None
) -> dict[str, str]:
    """The container's environment as the kubelet builds it; the completion index is `index`, other downward-API
    fields take their value from `fields` (fieldPath -> value)."""
    fields = {COMPLETION_INDEX: str(index), f"metadata.labels['{INDEX_LABEL}']": str(index), **(fields or {})}
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
            env[e["name"]] = fields.get(path, f"<{path}>")
        else:  # secretKeyRef, resourceFieldRef
            env[e["name"]] = "dummy"
    return env


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """$(VAR) references, substituted as the kubelet does (an unknown one is left as it is)."""
    return [VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in argv]


def parse(program: str, argv: list[str]) -> argparse.Namespace:
    """Parse argv with the command's own parser and build its config dataclass (which validates the values)."""
    from paramserver.config import ServerConfig, from_arguments
    from worker.train.trainer import TrainConfig

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = parsers()[program]().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{program} refuses {argv}:\n{err.getvalue()}")
    if program == "ps-serve":  # no config dataclass: its parser is all it has
        return args
    try:
        from_arguments(ServerConfig if program == "ps-server" else TrainConfig, args)
    except ValueError as exc:
        pytest.fail(f"{program} {argv}: {exc}")
    return args


def job_fields(job: dict[str, Any]) -> dict[str, str]:
    """Downward-API values of a Job's pods besides the completion index."""
    return {f"metadata.labels['{JOB_NAME_LABEL}']": job["metadata"]["name"]}


def resolved_job(r: Rendered, job: dict[str, Any], index: int = 0) -> tuple[dict[str, Any], argparse.Namespace]:
    """The main container of a Job and its parsed command line, for completion index `index`."""
    container = containers(job, init=False)[0]
    program, argv = invocation(container)
    return container, parse(program, expand(argv, env_values(r, container, index, job_fields(job))))


def resolved(r: Rendered, component: dict[str, str], index: int = 0) -> tuple[dict[str, Any], argparse.Namespace]:
    """The main container of a component's Job (the shards: replica 0's) and its parsed command line."""
    return resolved_job(r, r.job(component), index)


def shard_jobs(r: Rendered) -> list[dict[str, Any]]:
    """Every shard Job in replica order: one, or with --replicas 2 one per copy of the parts (replica 0 first)."""
    found = r.jobs(SHARD)
    assert found, f"{r.overlay}: no shard Job"
    return sorted(found, key=lambda j: resolved_job(r, j)[1].replica_index)


def serving_deployments(r: Rendered) -> list[dict[str, Any]]:
    """components/serving's Deployment (ps-serve), where the overlay has it."""
    return [d for d in r.all("Deployment") if labels_match(SERVING, pod_labels(d))]


def replicas(r: Rendered) -> int:
    return int(resolved_job(r, shard_jobs(r)[0])[1].replicas)


def ps_containers(r: Rendered) -> Iterator[tuple[dict[str, Any], dict[str, Any], str, list[str]]]:
    for w in workloads(r):
        for c in containers(w):
            program, argv = invocation(c)
            if program in parsers():
                yield w, c, program, argv


def shard_names(r: Rendered) -> list[str]:
    """Every shard process's DNS name, <job>-<index>.<subdomain>, part-major: part 0's replicas in turn, then
    part 1's, ... (one Job: just the Job's pods in index order)."""
    jobs = shard_jobs(r)
    parts = jobs[0]["spec"]["completions"]
    return [f"{j['metadata']['name']}-{i}.{pod_spec(j)['subdomain']}" for i in range(parts) for j in jobs]


def shard_pod_labels(r: Rendered) -> list[dict[str, str]]:
    return [pod_labels(j) for j in shard_jobs(r)]


def headless_service(r: Rendered) -> dict[str, Any]:
    found = [
        s
        for s in r.all("Service")
        if all(labels_match(s["spec"].get("selector", {}), labels) for labels in shard_pod_labels(r))
    ]
    assert len(found) == 1, f"{r.overlay}: expected one Service selecting every shard pod, found {len(found)}"
    return found[0]


def coordinator(r: Rendered) -> tuple[dict[str, Any], dict[str, Any]]:
    """The etcd StatefulSet and the headless Service that names its members."""
    (sts,) = [w for w in workloads(r) if labels_match(COORDINATOR, pod_labels(w))]
    assert sts["kind"] == "StatefulSet", "etcd members need a stable name and a volume each"
    (svc,) = [s for s in r.all("Service") if labels_match(s["spec"].get("selector", {}), pod_labels(sts))]
    assert svc["metadata"]["name"] == sts["spec"]["serviceName"]
    return sts, svc


def flags(argv: list[str]) -> dict[str, str]:
    """--key=value arguments as a map (etcd's command line)."""
    out = {}
    for a in argv:
        assert a.startswith("--") and "=" in a, f"write etcd flags as --key=value: {a!r}"
        key, value = a[2:].split("=", 1)
        out[key] = value
    return out


def port_of(container: dict[str, Any], port: int | str) -> dict[str, Any] | None:
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p
    return None


# -- the overlays ------------------------------------------------------------------------------------------------


def test_the_overlays_exist() -> None:
    assert {"cpu", "gpu", "replicated"} <= set(OVERLAYS), OVERLAYS
    assert replicas(render("replicated")) == 2


def test_no_secret_is_committed(rendered: Rendered) -> None:
    assert not rendered.all("Secret"), "Secrets are referenced by the manifests, created in the cluster, never rendered"


# -- the shard topology ------------------------------------------------------------------------------------------


def test_shards_are_an_indexed_job_behind_a_headless_service(rendered: Rendered) -> None:
    jobs = shard_jobs(rendered)
    assert len(jobs) == replicas(rendered), "one shard Job per copy of the parts"
    svc = headless_service(rendered)
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"].get("publishNotReadyAddresses") is True, "a restoring shard must be resolvable"
    for job in jobs:
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed"
        assert spec["completions"] == spec["parallelism"] >= 1, "one pod per shard, all running at once"
        assert spec["completions"] == jobs[0]["spec"]["completions"], "every Job holds a copy of every part"
        assert pod_spec(job)["subdomain"] == svc["metadata"]["name"]
        shard = containers(job, init=False)[0]
        for p in svc["spec"]["ports"]:
            target = port_of(shard, p.get("targetPort", p["port"]))
            assert target is not None, f"Service port {p['name']} targets {p.get('targetPort')}, not a shard port"
            assert target["containerPort"] == p["port"] and target["name"] == p["name"]


def test_peers_name_every_shard_in_order(rendered: Rendered) -> None:
    """--peers names every shard process: with one copy per part the Job's pods in index order, with --replicas 2
    both Jobs' pods part-major (s0r0,s0r1,s1r0,s1r1,...); each a pod of the headless Service."""
    names = shard_names(rendered)
    jobs = shard_jobs(rendered)
    parts = jobs[0]["spec"]["completions"]
    assert len(names) == parts * replicas(rendered)
    for replica, job in enumerate(jobs):
        grpc_port = port_of(containers(job, init=False)[0], "grpc")
        assert grpc_port is not None
        for index in range(parts):
            _, args = resolved_job(rendered, job, index)
            peers = [p.strip() for p in args.peers.split(",")]
            assert len(peers) == len(names), f"--peers lists {len(peers)} shard processes, the Jobs run {len(names)}"
            for want, peer in zip(names, peers, strict=True):
                host, port = peer.rsplit(":", 1)
                assert host == want or host.startswith(want + "."), f"peer {peer!r} is not shard process {want}"
                assert int(port) == grpc_port["containerPort"]
            assert args.shard_index == index, "--shard-index is the Job's completion index"
            assert args.replica_index == replica, "each Job is one copy of the parts"
            assert args.replicas == len(jobs)
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
    for w, c, program, argv in ps_containers(rendered):
        args = expand(argv, env_values(rendered, c, fields=job_fields(w)))
        unresolved = [a for a in args if VAR.search(a)]
        assert not unresolved, f"{c['name']}: $(VAR) references without an env var: {unresolved}"
        parse(program, args)
        seen.add(program)
    assert seen == {"ps-server", "ps-worker"} | ({"ps-serve"} if serving_deployments(rendered) else set())


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
    names = {
        e["valueFrom"]["configMapKeyRef"]["name"]
        for job in shard_jobs(rendered)
        for e in containers(job, init=False)[0]["env"]
        if "configMapKeyRef" in e.get("valueFrom", {})
    }
    options = option_strings("ps-server")
    for name in names:
        for key in rendered.configmap_data(name):
            assert "--" + key in options, f"ConfigMap {name}: {key!r} is not a ps-server flag"


def test_one_image_for_shards_and_workers(rendered: Rendered) -> None:
    ours = [*shard_jobs(rendered), rendered.job(WORKER), *serving_deployments(rendered)]
    images = {c["image"] for w in ours for c in containers(w)}
    assert len(images) == 1, images
    # Anything else (the replicated overlay's etcd) is a released image, pinned: a tag that is not latest.
    for w in workloads(rendered):
        if any(w is o for o in ours):
            continue
        for c in containers(w):
            name = c["image"].split("@")[0].rsplit("/", 1)[-1]
            assert "@sha256:" in c["image"] or (":" in name and not name.endswith(":latest")), c["image"]


# -- ending cleanly ----------------------------------------------------------------------------------------------


def test_jobs_end_when_training_is_done(rendered: Rendered) -> None:
    for job in [*shard_jobs(rendered), rendered.job(WORKER)]:
        spec, pod = job["spec"], pod_spec(job)
        assert pod["restartPolicy"] in ("Never", "OnFailure")
        if "podFailurePolicy" in spec:
            assert pod["restartPolicy"] == "Never", "a podFailurePolicy needs restartPolicy Never"
            names = {r.get("onExitCodes", {}).get("containerName") for r in spec["podFailurePolicy"]["rules"]}
            assert names - {None} <= {c["name"] for c in containers(job)}
        assert spec.get("ttlSecondsAfterFinished") is not None
    for job in shard_jobs(rendered):
        _, server = resolved_job(rendered, job)
        assert server.exit_when_done is True, "shards (every copy) must exit 0 once every worker finished"
    # Those restart forever. The exceptions: the replicated overlay's etcd (the coordinator) outlives the job
    # (deploy/README.md says so, and how to remove it), and components/serving's copies serve until deleted.
    forever = [
        d
        for d in rendered.docs
        if d["kind"] in ("StatefulSet", "Deployment", "DaemonSet")
        and not any(d is s for s in serving_deployments(rendered))
    ]
    if replicas(rendered) == 1:
        assert not forever, "those restart forever"
    else:
        assert [d["metadata"]["name"] for d in forever] == [coordinator(rendered)[0]["metadata"]["name"]]


def _wrapper(rendered: Rendered) -> str:
    scripts = set()
    for job in shard_jobs(rendered):
        command = containers(job, init=False)[0]["command"]
        assert command[:2] == ["/bin/sh", "-c"] and command[3] == "ps-server"
        scripts.add(command[2])
    assert len(scripts) == 1, "every shard Job runs the same wrapper"
    return scripts.pop()


def test_every_shard_job_runs_the_tested_wrapper(rendered: Rendered) -> None:
    assert _wrapper(rendered) == _wrapper(render("cpu"))


@pytest.mark.skipif(not os.path.exists("/bin/sh"), reason="needs /bin/sh")
@pytest.mark.parametrize(
    ("behaviour", "status"),
    [("done", 0), ("fail", 2), ("crash", 1), ("deposed", 3), ("term", 143)],
)
def test_the_shard_wrapper_turns_a_stop_into_a_failure(tmp_path: Path, behaviour: str, status: int) -> None:
    """Exit 0 by itself (job done) stays 0; exit 0 after SIGTERM becomes 143, so the Job replaces the shard. Any
    other status passes through: 2 (usage: fail the Job), 3 (a deposed copy: replace it, not counted)."""
    script = _wrapper(render("cpu"))
    fake = tmp_path / "ps-server"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import pathlib, signal, sys, time\n"
        "mode, marker = sys.argv[1], pathlib.Path(sys.argv[2])\n"
        "if mode != 'term':\n"
        "    sys.exit({'done': 0, 'fail': 2, 'crash': 1, 'deposed': 3}[mode])\n"
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

    for job in shard_jobs(rendered):
        shard, args = resolved_job(rendered, job)
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
    for job in shard_jobs(rendered):
        shard, args = resolved_job(rendered, job)
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


def test_the_dataset_s3_component_gives_the_workers_the_sdks_files_and_nothing_else(tmp_path: Path) -> None:
    """components/dataset-s3: the workers read a prepared dataset on S3 with the AWS SDK's credentials and config
    files from a Secret (tests/test_datasets.py streams from an S3 server configured by exactly these files)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = render_with_component("cpu", "servicemonitor", tmp_path / "a")
    r = render_with_component("cpu", "dataset-s3", tmp_path / "b")
    worker = containers(r.job(WORKER), init=False)[0]
    env = {e["name"]: e for e in worker["env"]}
    mounts = {m["name"]: m for m in worker["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(r.job(WORKER))["volumes"]}
    assert volumes["dataset-s3"]["secret"]["secretName"] == "paramserver-dataset-s3"
    assert mounts["dataset-s3"]["readOnly"] and mounts["dataset-s3"]["mountPath"] == "/etc/paramserver/s3"
    assert env["AWS_SHARED_CREDENTIALS_FILE"]["value"] == "/etc/paramserver/s3/credentials"
    assert env["AWS_CONFIG_FILE"]["value"] == "/etc/paramserver/s3/config"
    before = containers(plain.job(WORKER), init=False)[0]
    assert {e["name"] for e in before["env"]} <= set(env), "the worker's own settings are kept"
    assert not any("valueFrom" in e and "secretKeyRef" in e["valueFrom"] for e in worker["env"]), "no secret in env"
    assert pod_spec(r.job(SHARD)) == pod_spec(plain.job(SHARD)), "the shards do not read the dataset"


# -- network policy, disruption budget ---------------------------------------------------------------------------


def test_only_workers_reach_the_shards_grpc_and_data_ports(rendered: Rendered) -> None:
    shard_labels, worker_labels = pod_labels(rendered.job(SHARD)), pod_labels(rendered.job(WORKER))
    serving_labels = {k: v for d in serving_deployments(rendered) for k, v in pod_labels(d).items()}
    policies = [p for p in rendered.all("NetworkPolicy") if labels_match(p["spec"]["podSelector"], shard_labels)]
    assert len(policies) == 1, "one NetworkPolicy selects the shards"
    for labels in shard_pod_labels(rendered):
        assert labels_match(policies[0]["spec"]["podSelector"], labels), "it selects every shard Job's pods"
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
        serving_rule = all(
            set(peer) == {"podSelector"} and labels_match(peer["podSelector"], serving_labels) for peer in peers
        )
        if serving_rule:
            # components/serving: the serving copies follow their shards over gRPC, nothing else.
            assert serving_labels and ports == {grpc}, f"serving pods reach the shards' gRPC port only, not {ports}"
            assert not any(labels_match(peer["podSelector"], worker_labels) for peer in peers)
            continue
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
    jobs = shard_jobs(rendered)
    pdbs = [p for p in rendered.all("PodDisruptionBudget") if labels_match(p["spec"]["selector"], pod_labels(jobs[0]))]
    assert len(pdbs) == 1
    spec = pdbs[0]["spec"]
    assert all(labels_match(spec["selector"], labels) for labels in shard_pod_labels(rendered))
    assert not labels_match(spec["selector"], pod_labels(rendered.job(WORKER)))
    # Pods of a Job (no scale subresource) support only an integer minAvailable.
    assert "maxUnavailable" not in spec and isinstance(spec["minAvailable"], int)
    pods = sum(j["spec"]["completions"] for j in jobs)
    if replicas(rendered) == 1:
        # Every shard holds the only copy of its part: no voluntary disruption while the job trains.
        assert spec["minAvailable"] == pods
    else:
        # One copy at a time may go (its part's other copy carries on), never two: the second to go could be the
        # other copy of the same part, or the one still catching up.
        assert spec["minAvailable"] == pods - 1
    assert spec.get("unhealthyPodEvictionPolicy") == "AlwaysAllow", "a broken job never blocks a drain"


# -- security, resources, storage --------------------------------------------------------------------------------


def test_pods_run_unprivileged_on_a_read_only_root(rendered: Rendered) -> None:
    ours = [*shard_jobs(rendered), rendered.job(WORKER), *serving_deployments(rendered)]
    for w in workloads(rendered):
        pod = pod_spec(w)
        # Our image runs as its own user; another image (etcd) as a non-root, high uid (off the host's range).
        uid_ok: Callable[[Any], bool] = (
            (lambda u: u == IMAGE_UID) if any(w is o for o in ours) else (lambda u: isinstance(u, int) and u >= 10000)
        )
        assert pod.get("automountServiceAccountToken") is False
        psc = pod.get("securityContext", {})
        assert psc.get("runAsNonRoot") is True and uid_ok(psc.get("runAsUser"))
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault"
        templates = w["spec"].get("volumeClaimTemplates", [])
        volumes = {v["name"]: v for v in pod.get("volumes", [])} | {
            t["metadata"]["name"]: {"persistentVolumeClaim": {"claimName": t["metadata"]["name"]}} for t in templates
        }
        for c in containers(w):
            sc = c.get("securityContext", {})
            assert sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, c["name"]
            assert uid_ok(sc.get("runAsUser", psc.get("runAsUser"))), c["name"]
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

    checkpoint_dirs = set()
    for job in shard_jobs(rendered):
        shard, server = resolved_job(rendered, job)
        volume = volume_under(job, shard, server.checkpoint_dir)
        assert not volume["readOnly"]
        claim = rendered.named("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        assert "ReadWriteMany" in claim["spec"]["accessModes"], "shards on different nodes share the directory"
        from paramserver.config import ServerConfig, copy_dir

        # Where this process writes: with --replicas 2 the server keeps each copy under copy-R of the directory.
        config = ServerConfig(
            replicas=server.replicas, coordinator=server.coordinator, checkpoint_dir=server.checkpoint_dir
        )
        checkpoint_dirs.add(copy_dir(config, server.replica_index).checkpoint_dir)
    # Checkpoint and log files are named by shard, not by copy: the two copies of a shard keep them apart.
    assert len(checkpoint_dirs) == replicas(rendered), f"one checkpoint directory per copy: {checkpoint_dirs}"
    worker_container, worker = resolved(rendered, WORKER)
    for path in (worker.metrics_out, worker.save_model):
        if path:
            assert not volume_under(rendered.job(WORKER), worker_container, path)["readOnly"]
    pairs = [(job, *resolved_job(rendered, job)) for job in shard_jobs(rendered)]
    for w, c, args in [*pairs, (rendered.job(WORKER), worker_container, worker)]:
        for path in (args.tls_cert, args.tls_key, args.tls_ca, args.auth_token_file):
            if path:
                assert "secret" in volume_under(w, c, os.path.dirname(path)), f"{path} comes from a Secret"


# -- replicas (hot standby) --------------------------------------------------------------------------------------
# overlays/replicated (components/replicas): every part on two shard processes (two Indexed Jobs, replica 0 and
# replica 1), on two nodes, and a 3-member etcd that decides which copy is the primary (--coordinator).


def failure_action(job: dict[str, Any], exit_code: int | None = None, condition: str | None = None) -> str:
    """What a Job's podFailurePolicy does with a failed shard pod: the first rule that matches, else Count."""
    container = containers(job, init=False)[0]["name"]
    for rule in job["spec"].get("podFailurePolicy", {}).get("rules", []):
        codes = rule.get("onExitCodes")
        if codes and exit_code is not None and codes.get("containerName", container) == container:
            if (exit_code in codes["values"]) == (codes["operator"] == "In"):
                return str(rule["action"])
        for c in rule.get("onPodConditions", []):
            if c["type"] == condition and c.get("status", "True") == "True":
                return str(rule["action"])
    return "Count"


def anti_affinity_selects(pod: dict[str, Any], incoming: dict[str, str], other: dict[str, str], topology: str) -> bool:
    """Whether a required pod anti-affinity term of a pod (labels `incoming`) keeps a pod labelled `other` off its
    `topology` domain. matchLabelKeys are merged into the selector with the incoming pod's values, as the API
    server does when it creates the pod."""
    terms = pod.get("affinity", {}).get("podAntiAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", [])
    for term in terms:
        if term["topologyKey"] != topology:
            continue
        selector = {**term["labelSelector"]}
        extra = [{"key": k, "operator": "In", "values": [incoming[k]]} for k in term.get("matchLabelKeys", [])]
        selector["matchExpressions"] = [*selector.get("matchExpressions", []), *extra]
        if labels_match(selector, other):
            return True
    return False


def shard_pods(r: Rendered) -> list[tuple[dict[str, Any], int, dict[str, str]]]:
    """(Job, completion index, the pod's labels as the Job controller sets them) of every shard process."""
    return [
        (job, i, {**pod_labels(job), INDEX_LABEL: str(i), JOB_NAME_LABEL: job["metadata"]["name"]})
        for job in shard_jobs(r)
        for i in range(job["spec"]["completions"])
    ]


def test_every_copy_of_a_part_runs_as_a_hot_standby(rendered: Rendered) -> None:
    jobs = shard_jobs(rendered)
    parts = jobs[0]["spec"]["completions"]
    if replicas(rendered) == 1:
        assert len(jobs) == 1
        for index in range(parts):
            _, args = resolved_job(rendered, jobs[0], index)
            assert args.coordinator is None and args.replica_index == 0
        assert not [w for w in workloads(rendered) if labels_match(COORDINATOR, pod_labels(w))], "no etcd needed"
        return
    assert len(jobs) == 2, "replica 0 and replica 1 of every part: two Indexed Jobs"
    names = shard_names(rendered)
    for replica, job in enumerate(jobs):
        replication = port_of(containers(job, init=False)[0], "replication")
        assert replication is not None, "the replication port is a port of the shard container"
        for index in range(parts):
            _, args = resolved_job(rendered, job, index)
            assert (args.replicas, args.replica_index, args.shard_index) == (2, replica, index)
            own = args.peers.split(",")[2 * index + replica].rsplit(":", 1)[0]
            assert (
                own == names[2 * index + replica] == f"{job['metadata']['name']}-{index}.{pod_spec(job)['subdomain']}"
            )
            assert args.advertise_host == own, "it announces the name the other processes reach it by"
            assert args.replication_port == replication["containerPort"]


def test_the_backup_job_is_a_copy_of_the_first(rendered: Rendered) -> None:
    """The two shard Jobs differ only in their name and replica index: one template, no drift."""
    jobs = shard_jobs(rendered)
    if len(jobs) == 1:
        return

    def masked(job: dict[str, Any]) -> dict[str, Any]:
        spec = yaml.safe_load(yaml.safe_dump(job["spec"]))
        container = containers({"spec": spec}, init=False)[0]
        (arg,) = [a for a in container["args"] if a.startswith("--replica-index=")]
        var = VAR.fullmatch(arg.split("=", 1)[1])
        if var:  # --replica-index=$(VAR): the value of VAR differs
            (entry,) = [e for e in container["env"] if e["name"] == var.group(1)]
            entry["value"] = "<replica>"
        else:
            container["args"][container["args"].index(arg)] = "--replica-index=<replica>"
        return spec

    assert masked(jobs[0]) == masked(jobs[1])
    assert jobs[0]["metadata"]["labels"] == jobs[1]["metadata"]["labels"]


def test_the_coordinator_is_the_jobs_etcd(rendered: Rendered) -> None:
    if replicas(rendered) == 1:
        return
    sts, svc = coordinator(rendered)
    assert svc["spec"]["clusterIP"] == "None", "headless: one name per member"
    assert svc["spec"].get("publishNotReadyAddresses") is True, "members resolve each other before a quorum is up"
    members = sts["spec"]["replicas"]
    assert members >= 3 and members % 2 == 1, "an odd number of members, at least 3: one may go, two keep the quorum"
    assert sts["spec"].get("podManagementPolicy") == "Parallel", "no member is ready before a quorum is up"
    (etcd,) = containers(sts)
    assert ETCD_IMAGE.match(etcd["image"]), f"etcd 3.5 pinned by its release tag, not {etcd['image']}"
    client, peer, metrics = (port_of(etcd, name) for name in ("client", "peer", "metrics"))
    assert client is not None and peer is not None and metrics is not None
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}["client"] == client["containerPort"]
    name, service = sts["metadata"]["name"], svc["metadata"]["name"]
    member_names = [f"{name}-{i}.{service}" for i in range(members)]

    # Every shard process reaches every member by its name (the client tries them in turn).
    for job in shard_jobs(rendered):
        for index in range(job["spec"]["completions"]):
            _, args = resolved_job(rendered, job, index)
            urls = [urllib.parse.urlsplit(u.strip()) for u in args.coordinator.split(",")]
            assert all(u.scheme == "http" and u.port == client["containerPort"] for u in urls), args.coordinator
            assert sorted(u.hostname or "" for u in urls) == member_names, "--coordinator names every etcd member"

    # Each member's command line, as the kubelet expands it: its name, the cluster it bootstraps, its URLs.
    assert os.path.basename(etcd["command"][0]) == "etcd"
    namespace = sts["metadata"].get("namespace", "default")
    mounts = {m["mountPath"]: m["name"] for m in etcd["volumeMounts"]}
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    for i in range(members):
        pod = f"{name}-{i}"
        env = env_values(rendered, etcd, fields={"metadata.name": pod, "metadata.namespace": namespace})
        argv = expand(etcd["command"][1:] + etcd.get("args", []), env)
        assert not [a for a in argv if VAR.search(a)], f"unresolved $(VAR) in {argv}"
        f = flags(argv)
        assert f["name"] == pod
        cluster = dict(m.split("=", 1) for m in f["initial-cluster"].split(","))
        assert cluster == {
            f"{name}-{j}": f"http://{name}-{j}.{service}:{peer['containerPort']}" for j in range(members)
        }
        assert f["initial-advertise-peer-urls"] == cluster[pod]
        assert f["advertise-client-urls"] == f"http://{pod}.{service}:{client['containerPort']}"
        assert f["listen-client-urls"].endswith(f":{client['containerPort']}")
        assert f["listen-peer-urls"].endswith(f":{peer['containerPort']}")
        assert f["listen-metrics-urls"].endswith(f":{metrics['containerPort']}")
        assert f.get("enable-grpc-gateway", "true") == "true", "the shards speak etcd's JSON gateway"
        data = [m for path, m in mounts.items() if (f["data-dir"] + "/").startswith(path.rstrip("/") + "/")]
        assert data and data[0] in claims, "the data directory is on the member's own volume (volumeClaimTemplates)"

    # Probes on /health: liveness and startup check this member only (a lost quorum restarts nobody).
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = etcd[kind]["httpGet"]
        assert probe["path"].startswith("/health") and port_of(etcd, probe["port"]) is metrics
        if kind != "readinessProbe":
            assert "serializable=true" in probe["path"], f"{kind}: a member-local check"
    annotations = sts["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/port", str(metrics["containerPort"])) == str(metrics["containerPort"])


def test_the_two_copies_of_a_part_never_share_a_node(rendered: Rendered) -> None:
    if replicas(rendered) == 1:
        return
    host = "kubernetes.io/hostname"
    pods = shard_pods(rendered)
    for job, index, labels in pods:
        assert INDEX_LABEL not in pod_labels(job), "the completion index label comes from the Job controller"
        for other_job, other_index, other in pods:
            if other_job is job:
                continue
            apart = anti_affinity_selects(pod_spec(job), labels, other, host)
            if other_index == index:
                assert apart, f"{job['metadata']['name']}-{index} may share a node with its other copy"
            else:
                assert not apart, "only the copies of one part are kept apart (N parts need 2 nodes, not 2N)"
    # The etcd members too: one per node, so that a node loss takes one member at most.
    sts, _ = coordinator(rendered)
    labels = pod_labels(sts)
    assert anti_affinity_selects(pod_spec(sts), labels, labels, host), "two etcd members may share a node"


def test_a_deposed_copy_is_replaced_without_failing_the_job(rendered: Rendered) -> None:
    """Exit 3: a copy that finds the other one became the primary while it was cut off. The Job must replace the
    pod (it comes back as the backup) and not count it: podFailurePolicy Ignore (needs restartPolicy Never)."""
    for job in shard_jobs(rendered):
        assert pod_spec(job)["restartPolicy"] == "Never"
        assert job["spec"].get("podReplacementPolicy") == "Failed", "never two pods of one copy at once"
        assert failure_action(job, exit_code=2) == "FailJob", "a usage error fails the Job"
        assert failure_action(job, exit_code=1) == "Count"
        assert failure_action(job, exit_code=143) == "Count", "stopped by SIGTERM: replaced, counted"
        assert failure_action(job, condition="DisruptionTarget") == "Ignore", "evicted, preempted, drained"
        if replicas(rendered) == 2:
            assert failure_action(job, exit_code=3) == "Ignore", "a deposed copy is replaced, not counted"
            assert failure_action(job, exit_code=3, condition="DisruptionTarget") == "Ignore"


def test_the_replication_port_is_open_between_shard_pods(rendered: Rendered) -> None:
    if replicas(rendered) == 1:
        return
    shard_labels, worker_labels = shard_pod_labels(rendered), pod_labels(rendered.job(WORKER))
    (policy,) = [p for p in rendered.all("NetworkPolicy") if labels_match(p["spec"]["podSelector"], shard_labels[0])]
    for job in shard_jobs(rendered):
        container, args = resolved_job(rendered, job)
        port = args.replication_port
        rules = [r for r in policy["spec"]["ingress"] if {port, "replication"} & {p["port"] for p in r["ports"]}]
        assert rules, f"the replication port {port} is closed between the shards"
        for rule in rules:
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, "the replication port admits pods of this namespace only"
                assert all(labels_match(peer["podSelector"], labels) for labels in shard_labels), "every copy"
                assert not labels_match(peer["podSelector"], worker_labels), "not the workers"


def test_only_the_shards_reach_etcd(rendered: Rendered) -> None:
    if replicas(rendered) == 1:
        return
    sts, _ = coordinator(rendered)
    etcd_labels, shard_labels = pod_labels(sts), shard_pod_labels(rendered)
    worker_labels = pod_labels(rendered.job(WORKER))
    (etcd,) = containers(sts)
    client, peer = (port_of(etcd, n)["containerPort"] for n in ("client", "peer"))  # type: ignore[index]
    policies = [p for p in rendered.all("NetworkPolicy") if labels_match(p["spec"]["podSelector"], etcd_labels)]
    assert len(policies) == 1 and "Ingress" in policies[0]["spec"]["policyTypes"]
    admitted = {client: False, peer: False}
    for rule in policies[0]["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        assert ports and rule.get("from"), "every rule names its ports and its peers"
        for port in (client, peer):
            if port not in ports:
                continue
            for source in rule["from"]:
                assert set(source) == {"podSelector"}, f"port {port} admits pods of this namespace only"
                selects_shards = all(labels_match(source["podSelector"], labels) for labels in shard_labels)
                selects_members = labels_match(source["podSelector"], etcd_labels)
                assert not labels_match(source["podSelector"], worker_labels), f"workers reach etcd's port {port}"
                if port == client:
                    assert selects_shards and not selects_members, "the client port: the shards only"
                else:
                    assert selects_members and not selects_shards, "the peer port: the other members only"
            admitted[port] = True
    assert all(admitted.values()), admitted


def test_the_coordinator_keeps_its_quorum_through_a_drain(rendered: Rendered) -> None:
    if replicas(rendered) == 1:
        return
    sts, _ = coordinator(rendered)
    members, labels = sts["spec"]["replicas"], pod_labels(sts)
    pdbs = [p for p in rendered.all("PodDisruptionBudget") if labels_match(p["spec"]["selector"], labels)]
    assert len(pdbs) == 1
    spec = pdbs[0]["spec"]
    assert not any(labels_match(spec["selector"], s) for s in shard_pod_labels(rendered))
    kept = spec["minAvailable"] if "minAvailable" in spec else members - spec["maxUnavailable"]
    assert isinstance(kept, int) and kept >= members // 2 + 1, "a drain never takes the etcd quorum"


def test_tls_covers_every_copy(tmp_path: Path) -> None:
    """components/tls on top of the replicated overlay: both shard Jobs serve TLS (the patches select the shard
    Jobs by label, not by name)."""
    r = render_with_component("replicated", "tls", tmp_path)
    jobs = shard_jobs(r)
    assert len(jobs) == 2
    for job in jobs:
        container, args = resolved_job(r, job)
        assert args.tls_cert and args.tls_key and args.tls_ca and args.auth_token_file, job["metadata"]["name"]
        assert args.replicas == 2
        secrets = {v["secret"]["secretName"] for v in pod_spec(job)["volumes"] if "secret" in v}
        assert secrets == {"paramserver-shard-tls", "paramserver-auth"}
        assert "grpc" not in container["readinessProbe"], "the kubelet's gRPC probes cannot do TLS"


# -- serving copies (components/serving, overlays/serving) -------------------------------------------------------
# ps-serve in a Deployment: every pod holds a copy of every shard, follows training over the shards' gRPC port and
# answers reads (paramserver.v1.Serving) behind the Service paramserver-serving.

HEALTHCHECK = ROOT / "deploy" / "image" / "healthcheck.py"
MAX_FOLLOWERS = 4  # Follow streams a shard serves at once (docs/architecture.md, "Serving copies")


def check_serving(r: Rendered) -> None:
    """What must hold of the serving copies in any overlay that has them."""
    (deployment,) = serving_deployments(r)
    labels = pod_labels(deployment)
    assert labels_match(deployment["spec"]["selector"], labels)
    assert 1 <= deployment["spec"]["replicas"] <= MAX_FOLLOWERS, "a shard serves at most 4 Follow streams"
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, "a new copy is ready first"
    container = containers(deployment, init=False)[0]
    program, argv = invocation(container)
    assert program == "ps-serve"
    args = parse(program, expand(argv, env_values(r, container)))
    # It follows a shard of this job, by the address the shards' --peers give it.
    _, server = resolved(r, SHARD)
    assert args.server in server.peers.split(","), f"--server {args.server} is not a shard of the job"
    assert not any(resolved_job(r, j)[1].tls_cert for j in shard_jobs(r)), "ps-serve reads the shards in plaintext"
    assert args.shard_index is None, "every pod holds every shard's copy: any pod answers any read"
    assert args.host == "0.0.0.0"
    grpc, metrics = port_of(container, "grpc"), port_of(container, "metrics")
    assert grpc is not None and grpc["containerPort"] == args.port
    assert metrics is not None and metrics["containerPort"] == args.metrics_port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(args.metrics_port)
    # Probes: started once it listens (after up to --wait for the job's model), ready once every copy holds a
    # whole version (the image's health check asks Serving.Status), alive while it listens.
    startup, ready, live = (container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert startup["tcpSocket"]["port"] in ("grpc", args.port)
    assert startup["periodSeconds"] * startup["failureThreshold"] > args.wait, "startup outlasts --wait"
    assert live["tcpSocket"]["port"] in ("grpc", args.port)
    command = ready["exec"]["command"]
    assert command[0] == "python" and command[1] == "/opt/paramserver/healthcheck.py"
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert f"COPY healthcheck.py {command[1]}" in dockerfile, "the probe runs the health check the image holds"
    assert ready["timeoutSeconds"] > float(os.environ.get("PS_HEALTH_TIMEOUT", "3"))
    # The Service: the serving pods only, every port one of the container's, by name and number.
    (service,) = [s for s in r.all("Service") if labels_match(s["spec"].get("selector", {}), labels)]
    assert service["spec"].get("clusterIP") != "None", "one address for clients, ready pods only"
    assert not service["spec"].get("publishNotReadyAddresses"), "reads go to ready copies only"
    assert not any(labels_match(service["spec"]["selector"], s) for s in shard_pod_labels(r))
    for p in service["spec"]["ports"]:
        target = port_of(container, p["targetPort"])
        assert target is not None and target["containerPort"] == p["port"] and target["name"] == p["name"]
    # The network: reads from labelled clients, scrapes from Prometheus; the shards' gRPC port admits the copies.
    (policy,) = [p for p in r.all("NetworkPolicy") if labels_match(p["spec"]["podSelector"], labels)]
    admitted: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), "no rule admits everyone"
        for port in rule["ports"]:
            admitted.setdefault(port["port"], []).extend(rule["from"])
    lookup = port_of(container, "lookup")
    assert lookup is not None and lookup["containerPort"] == args.lookup_port, "the lookup socket, named in Status"
    assert set(admitted) == {args.port, args.lookup_port, args.metrics_port}
    for read in (args.port, args.lookup_port):
        assert all(set(peer) == {"podSelector"} for peer in admitted[read]), "reads from this namespace's pods"
        assert all(
            peer["podSelector"]["matchLabels"] == {"paramserver.io/serving-client": "true"} for peer in admitted[read]
        )
    assert all("namespaceSelector" in peer for peer in admitted[args.metrics_port]), "scrapes from Prometheus"
    (shards_policy,) = [
        p for p in r.all("NetworkPolicy") if labels_match(p["spec"]["podSelector"], shard_pod_labels(r)[0])
    ]
    shard_grpc = port_of(containers(r.job(SHARD), init=False)[0], "grpc")["containerPort"]  # type: ignore[index]
    assert any(
        shard_grpc in {p["port"] for p in rule["ports"]}
        and any(labels_match(peer.get("podSelector", {"x": "never"}), labels) for peer in rule["from"])
        for rule in shards_policy["spec"]["ingress"]
    ), "the shards admit the serving copies on their gRPC port"
    # Drains take one copy at a time, and only copies.
    (pdb,) = [p for p in r.all("PodDisruptionBudget") if labels_match(p["spec"]["selector"], labels)]
    assert pdb["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]
    assert not any(labels_match(pdb["spec"]["selector"], s) for s in shard_pod_labels(r))
    assert not labels_match(pdb["spec"]["selector"], pod_labels(r.job(WORKER)))
    # No volume but /tmp: a copy holds its values in memory and takes them again when it starts.
    assert {v["name"] for v in pod_spec(deployment)["volumes"]} == {"tmp"}


def test_the_serving_overlay_runs_serving_copies() -> None:
    assert "serving" in OVERLAYS
    check_serving(render("serving"))
    for overlay in OVERLAYS:
        if overlay != "serving":
            assert not serving_deployments(render(overlay)), f"{overlay}: serving is a component, added on purpose"


def test_serving_copies_follow_a_replicated_job(tmp_path: Path) -> None:
    """components/serving on top of overlays/replicated: ps-serve follows whichever copy of a part is primary."""
    r = render_with_component("replicated", "serving", tmp_path)
    assert replicas(r) == 2
    check_serving(r)
    (policy,) = [p for p in r.all("NetworkPolicy") if p["metadata"]["name"] == "paramserver-shard"]
    assert (
        len(policy["spec"]["ingress"])
        == len(render("replicated").named("NetworkPolicy", "paramserver-shard")["spec"]["ingress"]) + 1
    )


def test_the_serving_servicemonitor_scrapes_the_copies_as_the_serving_job(tmp_path: Path) -> None:
    r = render_with_component("serving", "serving-servicemonitor", tmp_path)
    (monitor,) = r.all("ServiceMonitor")
    (deployment,) = serving_deployments(r)
    selected = [s for s in r.all("Service") if labels_match(monitor["spec"]["selector"], s["metadata"]["labels"])]
    assert len(selected) == 1 and labels_match(selected[0]["spec"]["selector"], pod_labels(deployment))
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
    assert endpoint["port"] == "metrics"
    # No jobLabel: the job is the Service's name, what the serving alert rules select (not the shards' job).
    assert "jobLabel" not in monitor["spec"]
    job = selected[0]["metadata"]["name"]
    rules = (ROOT / "deploy" / "monitoring" / "serving-alerts.yml").read_text()
    assert f'job="{job}"' in rules and 'job="paramserver"' in rules


def _healthcheck() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("ps_healthcheck", HEALTHCHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_health_check_finds_ps_serves_port() -> None:
    hc = _healthcheck()
    assert hc._serving_target(["--server", "s:50051", "--host=0.0.0.0", "--port=50061"]) == "127.0.0.1:50061"
    assert hc._serving_target(["--server", "s:50051", "--host", "10.0.0.7", "--port", "7000"]) == "10.0.0.7:7000"
    assert hc._serving_target(["--server", "s:50051"]) == "127.0.0.1:50061"
    from paramserver.serving.cli import build_parser

    assert build_parser().parse_args(["--server", "s:1"]).port == hc.DEFAULT_SERVING_PORT


def test_the_health_check_is_ready_only_when_the_copies_are(capsys: pytest.CaptureFixture[str]) -> None:
    """healthcheck.py against a Serving service that answers Status: not ready, then ready, then gone."""
    from concurrent import futures

    import grpc

    from paramserver.v1 import ps_pb2

    hc = _healthcheck()
    state = {"ready": False}

    def status(_: bytes, __: Any) -> ps_pb2.ServingStatus:
        return ps_pb2.ServingStatus(ready=state["ready"], versions=[7, 7], shards=2)

    handler = grpc.method_handlers_generic_handler(
        "paramserver.v1.Serving",
        {
            "Status": grpc.unary_unary_rpc_method_handler(
                status,
                request_deserializer=ps_pb2.ServingStatusRequest.FromString,
                response_serializer=ps_pb2.ServingStatus.SerializeToString,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    target = f"127.0.0.1:{port}"
    try:
        assert hc.check_serving(target) == 1
        assert "not ready" in capsys.readouterr().out
        state["ready"] = True
        assert hc.check_serving(target) == 0
        assert "ready (serving copies of 2 shard(s) at version 7, 7)" in capsys.readouterr().out
    finally:
        server.stop(grace=None).wait()
    assert hc.check_serving(target) == 1
    assert "unreachable" in capsys.readouterr().out
