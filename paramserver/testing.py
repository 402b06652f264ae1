"""pytest plugin (registered through the `pytest11` entry point): real shards for your own tests.

    def test_my_training(ps_cluster):
        with PSClient(ps_cluster.address) as client:
            client.register(model)
            ...

`ps_cluster` starts real gRPC shards on 127.0.0.1 with OS-chosen ports (threads, so it is fast) and stops them
after the test, also when it fails. Override the `ps_cluster_config` or `ps_cluster_shards` fixtures in your
conftest.py (or a test module) to change the job; use `ps_cluster_factory` for several clusters or other setups.
`make_pki` writes a throwaway CA and certificates for testing TLS and mutual TLS:

    pki = make_pki(tmp_path)
    cluster = ps_cluster_factory(config.replace(tls_cert=pki["server_cert"], tls_key=pki["server_key"]))
    PSClient(cluster.address, tls_ca=pki["ca"])
"""

from __future__ import annotations

import datetime
import ipaddress
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
