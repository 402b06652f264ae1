"""What every part of the report shares: a results document's figures by id, number formatting, markdown tables and
the transports' names."""

from __future__ import annotations

import math
from typing import Any

Doc = dict[str, Any]


def _ok(x: Any) -> bool:
    return isinstance(x, int | float) and not math.isnan(x)


def fmt(x: Any, unit: str = "") -> str:
    """A number with about three significant digits; a dash for none."""
    if not _ok(x):
        return "—"
    a = abs(x)
    text = f"{x:.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 0.1 else f"{x:.3f}"
    return text + unit


class _Index:
    def __init__(self, doc: Doc) -> None:
        self.by_id = {f["id"]: f for f in doc["figures"]}

    def get(self, fid: str) -> dict[str, Any] | None:
        return self.by_id.get(fid)

    def median(self, fid: str) -> float | None:
        f = self.by_id.get(fid)
        return f["median"] if f else None

    def ratio(self, fid: str, base: str) -> float | None:
        f = self.by_id.get(fid)
        return f.get("ratios", {}).get(base) if f else None

    def section(self, name: str) -> list[dict[str, Any]]:
        return [f for f in self.by_id.values() if f["section"] == name]


_PATHS = {
    "shm": "shared memory",
    "socket": "data socket",
    "socket-bf16": "data socket, bf16 wire",
    "float32": "gRPC",
    "bf16": "gRPC, bf16 wire",
    "socket-tls": "data socket, TLS",
    "float32-tls": "gRPC, TLS",
}


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]
