"""A multi-host lab without Kubernetes: one network namespace per "host" on a bridge of its own.

Everything this module creates is named with one prefix, ``psnt<pid>`` (the pid of the process that built it):

    <prefix>-br                 a namespace holding only the bridge ``br0`` (nothing is added to the root namespace)
    <prefix>-<host>             one namespace per host (shard-0, shard-1, worker-0, worker-1), ``lo`` up, ``eth0``
                                with its address on the lab subnet; the veth's other end (named like the host) is a
                                port of ``br0``
    /etc/netns/<prefix>-<host>/hosts
                                the host names of every host, so that names resolve inside the namespaces the way
                                pods' do (``ip netns exec`` bind-mounts this file over /etc/hosts)
    table inet psnt             nftables tables, only ever inside a host's namespace (partition / cut / reset)

Deleting a namespace deletes its veth end (and so the pair), its bridge and its nftables tables; ``Lab.down`` also
kills any process still inside and removes the /etc/netns folders. ``cleanup_stale`` removes whatever a crashed
earlier run left (any ``psnt<pid>-*`` whose pid is gone).

Command line (as root), from the repository root:

    python deploy/netns/netlab.py cleanup            # remove leftovers of dead runs
    python deploy/netns/netlab.py probe --out F ADDR...   # (inside a namespace) log every shard's version
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

PREFIX_BASE = "psnt"
NETNS_ETC = Path("/etc/netns")
SUBNET = "10.213.77"  # a private /24 that exists only on the lab's own bridge, in the lab's own namespace
DEFAULT_HOSTS = {"shard-0": 10, "shard-1": 11, "worker-0": 20, "worker-1": 21}
NFT_TABLE = "psnt"
_STALE = re.compile(rf"^{PREFIX_BASE}(\d+)-")


def _run(argv: Sequence[str], *, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed with {proc.returncode}: {proc.stderr.strip()}")
    return proc


def netns_available() -> str | None:
    """None when this process can build the lab, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veths, nftables)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    try:
        proc = _run(["ip", "netns", "list"], check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns` is unavailable: {exc}"
    if proc.returncode != 0:
        return f"`ip netns` is unavailable: {proc.stderr.strip()}"
    return None


def list_netns() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_netns_processes(ns: str, grace: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process inside namespace `ns` (only ever a lab namespace); return their pids."""
    pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def remove_netns(ns: str) -> None:
    """Kill what runs in `ns`, delete it (with its veth, bridge, nftables tables) and its /etc/netns folder."""
    if not ns.startswith(PREFIX_BASE):
        raise ValueError(f"refusing to remove {ns!r}: not a lab namespace")
    if ns in list_netns():
        kill_netns_processes(ns)
        _run(["ip", "netns", "del", ns], check=False)
    folder = NETNS_ETC / ns
    if folder.is_dir():
        shutil.rmtree(folder, ignore_errors=True)
    _rmdir_netns_etc()


def _rmdir_netns_etc() -> None:
    """Remove /etc/netns itself only when it is empty (it did not exist before the first lab)."""
    try:
        NETNS_ETC.rmdir()
    except OSError:
        pass


def cleanup_stale(also_prefix: str | None = None) -> list[str]:
    """Remove every psnt<pid>-* namespace and /etc/netns folder whose pid is dead (or whose prefix is given)."""
    names = set(list_netns())
    if NETNS_ETC.is_dir():
        names |= {p.name for p in NETNS_ETC.iterdir()}
    removed = []
    for name in sorted(names):
        m = _STALE.match(name)
        if not m:
            continue
        if (also_prefix and name.startswith(also_prefix + "-")) or not _pid_alive(int(m.group(1))):
            remove_netns(name)
            removed.append(name)
    return removed


class Lab:
    """A bridge and one namespace per host; `up()` builds it, `down()` removes all of it (idempotent)."""

    def __init__(self, prefix: str | None = None, hosts: Mapping[str, int] | None = None) -> None:
        self.prefix = prefix or f"{PREFIX_BASE}{os.getpid()}"
        if not _STALE.match(self.prefix + "-"):
            raise ValueError(f"prefix must look like {PREFIX_BASE}<digits>, not {self.prefix!r}")
        self.hosts = dict(hosts or DEFAULT_HOSTS)
        self.bridge_ns = f"{self.prefix}-br"
        self.procs: list[subprocess.Popen[bytes]] = []

    # -- names -------------------------------------------------------------------------------------------------

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts[host]}"

    def namespaces(self) -> list[str]:
        return [self.bridge_ns] + [self.ns(h) for h in self.hosts]

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    # -- build and remove --------------------------------------------------------------------------------------

    def up(self) -> Lab:
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        br = self.bridge_ns
        _run(["ip", "netns", "add", br])
        _run(["ip", "-n", br, "link", "set", "lo", "up"])
        _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        hosts_file = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" + "".join(
            f"{self.address(h)}\t{h}\n" for h in self.hosts
        )
        for host in self.hosts:
            ns = self.ns(host)
            _run(["ip", "netns", "add", ns])
            # Both ends are created in lab namespaces: nothing ever appears in the root namespace.
            _run(["ip", "-n", br, "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "-n", br, "link", "set", host, "master", "br0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            folder = NETNS_ETC / ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(hosts_file)

    def down(self) -> None:
        """Stop every process this lab started, then remove its namespaces and /etc/netns folders."""
        self.stop_all()
        for ns in reversed(self.namespaces()):
            remove_netns(ns)

    # -- processes ---------------------------------------------------------------------------------------------

    def popen(
        self, host: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start argv inside a host's namespace (`ip netns exec` execs it: the pid is the program's), output to log."""
        full_env = dict(os.environ)
        full_env.update(env or {})
        with open(log, "wb") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                self.exec_argv(host, argv), stdout=out, stderr=subprocess.STDOUT, env=full_env, stdin=subprocess.DEVNULL
            )
        self.procs.append(proc)
        return proc

    def exec(self, host: str, argv: Sequence[str], input: str | None = None) -> subprocess.CompletedProcess[str]:
        return _run(self.exec_argv(host, argv), input=input)

    def stop_all(self, grace: float = 10.0) -> None:
        running = [p for p in self.procs if p.poll() is None]
        for proc in running:
            proc.terminate()
        deadline = time.monotonic() + grace
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # -- faults ------------------------------------------------------------------------------------------------

    def partition(self, host: str, keep_loopback: bool = False) -> None:
        """Drop every packet into and out of a host's namespace (a table of our own in that namespace).

        keep_loopback: except on `lo`, so that the host's own processes still reach each other (and a test can
        still ask them something with `exec`, on 127.0.0.1) while nothing gets in or out of the host."""
        lo_in = ' iifname "lo" accept;' if keep_loopback else ""
        lo_out = ' oifname "lo" accept;' if keep_loopback else ""
        self.exec(
            host,
            ["nft", "-f", "-"],
            input=f"""table inet {NFT_TABLE} {{
  chain input {{ type filter hook input priority 0; policy drop;{lo_in} }}
  chain output {{ type filter hook output priority 0; policy drop;{lo_out} }}
}}
""",
        )

    def cut(self, host: str, peers: Sequence[str]) -> None:
        """Drop every packet between a host and the given other hosts, both ways (one table in the host's
        namespace: its input from them, its output to them); the rest of its traffic flows. `heal(host)` ends it."""
        if not peers or host in peers:
            raise ValueError(f"cut {host!r} from other hosts, not from {list(peers)!r}")
        addresses = ", ".join(self.address(p) for p in peers)
        self.exec(
            host,
            ["nft", "-f", "-"],
            input=f"""table inet {NFT_TABLE} {{
  chain input {{ type filter hook input priority 0; ip saddr {{ {addresses} }} drop; }}
  chain output {{ type filter hook output priority 0; ip daddr {{ {addresses} }} drop; }}
}}
""",
        )

    def reset_tcp(self, host: str) -> None:
        """Answer every TCP segment into or out of a host's namespace with a reset."""
        self.exec(
            host,
            ["nft", "-f", "-"],
            input=f"""table inet {NFT_TABLE} {{
  chain input {{ type filter hook input priority 0; meta l4proto tcp iifname "eth0" reject with tcp reset; }}
  chain output {{ type filter hook output priority 0; meta l4proto tcp oifname "eth0" reject with tcp reset; }}
}}
""",
        )

    def heal(self, host: str) -> None:
        """Remove the host's nftables table."""
        self.exec(host, ["nft", "delete", "table", "inet", NFT_TABLE])

    def nft_tables(self, host: str) -> str:
        return self.exec(host, ["nft", "list", "tables"]).stdout

    def limit_bandwidth(self, host: str, rate: str = "50mbit", burst: str = "32kbit", latency: str = "400ms") -> None:
        """A token bucket on both ends of the host's link: its uploads (eth0) and its downloads (the bridge port).
        Called again, it sets the new limit in place of the old one."""
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        _run(["ip", "-n", self.ns(host), "link", "set", "eth0", "up"])
        _run(["tc", "-n", self.ns(host), "qdisc", "replace", "dev", "eth0", *tbf])
        _run(["tc", "-n", self.bridge_ns, "qdisc", "replace", "dev", host, *tbf])

    def link_bytes(self, host: str) -> tuple[int, int]:
        """The bytes the host's link has carried so far, (sent by the host, received by it): its token buckets'
        counters (after limit_bandwidth; setting a new limit starts them again)."""
        up = _run(["tc", "-s", "-n", self.ns(host), "qdisc", "show", "dev", "eth0"]).stdout
        down = _run(["tc", "-s", "-n", self.bridge_ns, "qdisc", "show", "dev", host]).stdout
        counts = [re.search(r"Sent (\d+) bytes", text) for text in (up, down)]
        if not all(counts):
            raise RuntimeError(f"no byte counters on {host}'s link (limit_bandwidth first):\n{up}{down}")
        return int(counts[0][1]), int(counts[1][1])  # type: ignore[index]

    def qdiscs(self, host: str) -> str:
        return (
            _run(["tc", "-n", self.ns(host), "qdisc", "show", "dev", "eth0"]).stdout
            + _run(["tc", "-n", self.bridge_ns, "qdisc", "show", "dev", host]).stdout
        )

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


# -- probe: runs inside a namespace -----------------------------------------------------------------------------


@contextlib.contextmanager
def fresh_lab(hosts: Mapping[str, int] | None = None) -> Iterator[Lab]:
    """A lab built for one test and removed after it whatever happens (a SIGTERM to the test run included), first
    clearing what a crashed earlier run left; AssertionError if a namespace or /etc/netns folder is left."""
    cleanup_stale()
    lab = Lab(prefix=f"{PREFIX_BASE}{os.getpid()}", hosts=hosts)

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        lab.up()
        yield lab
    finally:
        try:
            lab.down()
            cleanup_stale(also_prefix=lab.prefix)
            left = [n for n in list_netns() if n.startswith(lab.prefix + "-")]
            assert not left, f"namespaces left behind: {left}"
            assert not any((NETNS_ETC / n).exists() for n in lab.namespaces())
        finally:
            signal.signal(signal.SIGTERM, previous)


def probe(addresses: Sequence[str], out: str, interval: float) -> int:
    """Append {"t0": unix time asked, "t": unix time answered, "v": [version of each shard, -1 if unreachable]}
    to `out` every `interval` s. The versions were current at some moment between t0 and t: the shards' versions
    only rise, so each is at least the version at t0 and at most the version at t.

    Stops on SIGTERM, or when its parent (the test) is gone.
    """
    import grpc

    from paramserver.v1 import ps_pb2, ps_pb2_grpc

    parent = os.getppid()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    channels = [grpc.insecure_channel(a) for a in addresses]
    stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in channels]
    with open(out, "a", buffering=1) as f:
        while os.getppid() == parent:
            versions = []
            asked = time.time()
            for stub in stubs:
                try:
                    versions.append(int(stub.GetTopology(ps_pb2.GetTopologyRequest(), timeout=2).version))
                except grpc.RpcError:
                    versions.append(-1)
            f.write(json.dumps({"t0": round(asked, 3), "t": round(time.time(), 3), "v": versions}) + "\n")
            time.sleep(interval)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="netlab", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("cleanup", help="remove the namespaces and /etc/netns folders of dead psnt<pid> runs")
    p = sub.add_parser("probe", help="log the version of each shard (run inside a lab namespace)")
    p.add_argument("--out", required=True)
    p.add_argument("--interval", type=float, default=0.25)
    p.add_argument("addresses", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "cleanup":
        for name in cleanup_stale():
            print(f"removed {name}")
        return 0
    return probe(args.addresses, args.out, args.interval)


if __name__ == "__main__":
    sys.exit(main())
