"""The coordinator: where each replicated shard's configuration lives, in etcd, changed only by compare-and-swap.

A shard with `--replicas 2` runs as two copies. Which copy is the primary, which copies hold every acknowledged
update (the in-sync set), and the epoch (one more at each change of primary) are one value in etcd, at
`/paramserver/<job>/shard/<index>`. Every change is a transaction that succeeds only if the value is still the
one its writer read (its mod_revision), so of two copies that each want to act on what they saw (a backup taking
over, a primary going on without its backup) exactly one wins; etcd's Raft keeps that true while a majority of
its members is up. A copy that is not in the in-sync set can never become primary: it may lack acknowledged
updates.

The client speaks etcd's JSON gateway (`/v3/kv/range`, `/v3/kv/txn`, served by every etcd 3.4+ on its client
port) with the standard library: a few small requests per failure, none per push.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from typing import Any

PREFIX = "/paramserver"


class CoordinatorUnavailable(Exception):
    """No etcd endpoint answered (or one answered with an error): nothing was decided."""


@dataclass(frozen=True)
class PartConfig:
    """One shard's replication configuration as stored (`revision`: etcd's mod_revision it was read at)."""

    epoch: int
    primary: int
    in_sync: tuple[int, ...]
    links: dict[int, str] = field(default_factory=dict)  # copy -> its replication address (host:port)
    done: bool = False  # the job finished (its primary stopped with --exit-when-done); a new run clears it
    revision: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "primary": self.primary,
            "in_sync": list(self.in_sync),
            "links": {str(k): v for k, v in self.links.items()},
            "done": self.done,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any], revision: int) -> PartConfig:
        return cls(
            epoch=int(doc["epoch"]),
            primary=int(doc["primary"]),
            in_sync=tuple(int(r) for r in doc["in_sync"]),
            links={int(k): str(v) for k, v in doc.get("links", {}).items()},
            done=bool(doc.get("done", False)),
            revision=revision,
        )

    def but(self, **changes: Any) -> PartConfig:
        """A copy with some fields changed."""
        return replace(self, **changes)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Etcd:
    """A minimal etcd v3 client over its JSON gateway: read a key, compare-and-swap it."""

    def __init__(self, urls: str, timeout: float = 2.0) -> None:
        self.urls = [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]
        if not self.urls:
            raise ValueError("no coordinator URL given")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"the coordinator URL {url!r} must start with http:// or https://")
        self.timeout = timeout

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        errors = []
        for url in self.urls:
            request = urllib.request.Request(
                url + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                    doc: dict[str, Any] = json.loads(reply.read())
                    return doc
            except (OSError, urllib.error.URLError, ValueError) as exc:
                errors.append(f"{url}: {exc}")
        raise CoordinatorUnavailable("; ".join(errors))

    def get(self, key: str) -> tuple[dict[str, Any] | None, int]:
        """The key's JSON value and mod_revision, or (None, 0) where it does not exist."""
        doc = self._post("/v3/kv/range", {"key": _b64(key)})
        kvs = doc.get("kvs") or []
        if not kvs:
            return None, 0
        value = json.loads(base64.b64decode(kvs[0].get("value", "")) or b"null")
        return value, int(kvs[0]["mod_revision"])

    def cas(self, key: str, value: dict[str, Any], revision: int) -> int:
        """Set the key to `value` if its mod_revision is still `revision` (0: if it does not exist yet); return
        its new mod_revision, or 0 where it was not set."""
        if revision:
            compare = {"key": _b64(key), "target": "MOD", "mod_revision": str(revision)}
        else:
            compare = {"key": _b64(key), "target": "CREATE", "create_revision": "0"}
        put = {"request_put": {"key": _b64(key), "value": _b64(json.dumps(value))}}
        doc = self._post("/v3/kv/txn", {"compare": [compare], "success": [put]})
        if not doc.get("succeeded", False):
            return 0
        return int(doc["header"]["revision"])


class PartRegister:
    """One shard's configuration in the coordinator."""

    def __init__(self, etcd: Etcd, job: str, index: int) -> None:
        self.etcd = etcd
        self.key = f"{PREFIX}/{job}/shard/{index}"

    def read(self) -> PartConfig | None:
        value, revision = self.etcd.get(self.key)
        return None if value is None else PartConfig.from_json(value, revision)

    def swap(self, old: PartConfig | None, new: PartConfig) -> PartConfig | None:
        """Write `new` if the stored configuration is still `old` (None: none yet); return it as stored (with
        its revision), or None where another change came first."""
        revision = self.etcd.cas(self.key, new.to_json(), old.revision if old is not None else 0)
        return new.but(revision=revision) if revision else None

    def mark_done(self, primary: int, tries: int = 10) -> None:
        """Record that the job is done, while copy `primary` is the primary: read again and retry where a swap lost
        to a change that came first or the coordinator did not answer in time (`tries` times)."""
        for _ in range(tries):
            try:
                cfg = self.read()
                if cfg is None or cfg.primary != primary or cfg.done:
                    return
                if self.swap(cfg, cfg.but(done=True)) is not None:
                    return
            except CoordinatorUnavailable:
                time.sleep(0.1)
