"""The consistency modes: one registry keyed by ps.proto's `Mode` enum.

The config's choices and help, the servicer's Topology, the client's reading of it, the trainer's overlap check and
the demo all read this table; the policies that implement the modes are registered per mode in
paramserver.shard.consistency. Light: protobuf only, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from paramserver.v1 import ps_pb2


@dataclass(frozen=True)
class Mode:
    """One consistency mode: its wire value and what a worker needs to know of it."""

    wire: ps_pb2.Mode  # its ps.proto Mode value
    overlap: bool  # workers may send a gradient one step late (worker.train.overlap): updates apply on arrival
    help: str  # one line, for --help

    @property
    def name(self) -> str:
        """The mode's name in flags, configs and logs: its enum name, lowercased."""
        return ps_pb2.Mode.Name(self.wire).lower()


_REGISTERED = (
    Mode(ps_pb2.SYNC, overlap=False, help="average one gradient per live worker, apply once"),
    Mode(ps_pb2.ASYNC, overlap=True, help="apply each gradient on arrival"),
    Mode(
        ps_pb2.SSP,
        overlap=True,
        help="bounded staleness: async, but a worker --staleness steps ahead of the slowest live worker waits at "
        "its pull",
    ),
)
BY_WIRE: dict[int, Mode] = {m.wire: m for m in _REGISTERED}
BY_NAME: dict[str, Mode] = {m.name: m for m in _REGISTERED}
NAMES: tuple[str, ...] = tuple(BY_NAME)  # in the enum's order: sync, async, ssp


def _check_registry() -> None:
    """Fail at import unless every Mode a server may send has exactly one entry."""
    sent = set(ps_pb2.Mode.values()) - {ps_pb2.MODE_UNSPECIFIED}
    if set(BY_WIRE) != sent or len(BY_WIRE) != len(_REGISTERED):
        missing = sorted(ps_pb2.Mode.Name(v) for v in sent - set(BY_WIRE))
        raise ImportError(f"paramserver.modes: every ps.proto Mode needs one entry; missing {missing}")


_check_registry()


def mode(name: str) -> Mode:
    """The registered mode of this name; ValueError naming the choices for any other."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"mode must be one of {', '.join(NAMES)}, not {name!r}") from None


def mode_wire(name: str) -> ps_pb2.Mode:
    """The ps.proto Mode value of a mode name (ValueError for an unknown name)."""
    return mode(name).wire


def mode_name(wire: int, default: str | None = None) -> str:
    """The name of a ps.proto Mode value; `default` for a value this code does not know (a newer server), or
    ValueError when no default is given."""
    found = BY_WIRE.get(wire)
    if found is not None:
        return found.name
    if default is not None:
        return default
    raise ValueError(f"unknown ps.proto Mode {wire}; this code knows {', '.join(NAMES)}")


def describe() -> str:
    """The modes in words, one clause each, for --help."""
    return ", ".join(f"{m.name} ({m.help})" for m in _REGISTERED)
