"""The bounds ps.proto declares on its fields, and the one place a shard decodes the requests it receives.

ps.proto gives every string, bytes and repeated field a bound as a field option: `(Bound.max_bytes)` (a string's
UTF-8 length, a bytes field's length; each element's on a repeated string) and `(Bound.max_items)` (a repeated
field's length). A `decoder` (gRPC unary requests, doorbell and data-socket frames) or `stream_decoder` (the
messages of a client stream) parses raw bytes and checks them, so that bytes which are no valid message become
Undecodable and a field past its bound OutOfBounds (both INVALID_ARGUMENT, naming the RPC, the message type, the
field and the bound) before anything else reads the request. `check` checks a message already decoded.

The checks of a message type are built once, from its descriptor: flat tuples of (field name, bound), and nested
message types only where they hold a bounded field (Chunk holds none: a chunk's data is bounded by the message size
limit, and a stream's chunks take codec's fast path without a check). A check then costs a getattr and a len per
bounded field, and none at all for a message smaller than every bound of its type.

Dependency rule: this module imports only errors, codec and the generated stubs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from paramserver.errors import OutOfBounds, Undecodable
from paramserver.v1 import ps_pb2
from paramserver.wire import codec

M = TypeVar("M", bound=Message)

_STRING, _BYTES, _MESSAGE = FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE
Found = tuple[str, str]  # (the field's path within the message, what is wrong with it)
_UNBOUNDED = 1 << 62  # more than any message holds
_MAX_BYTES, _MAX_ITEMS = ps_pb2.Bound.max_bytes, ps_pb2.Bound.max_items  # the options, see ps.proto


def declared(field: FieldDescriptor) -> tuple[int | None, int | None]:
    """The (max_bytes, max_items) ps.proto declares for a field; None where it declares none."""
    options = field.GetOptions()
    declares = options.HasExtension
    max_bytes = options.Extensions[_MAX_BYTES] if declares(_MAX_BYTES) else None
    max_items = options.Extensions[_MAX_ITEMS] if declares(_MAX_ITEMS) else None
    return max_bytes, max_items


def utf8_length(text: str) -> int:
    """A string's length in UTF-8 bytes (its length for ASCII, which `isascii` tells without a scan)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _over_bytes(size: int, bound: int) -> str:
    return f"is {size} bytes, over its bound of {bound} bytes (max_bytes in ps.proto)"


def _over_items(count: int, bound: int) -> str:
    return f"holds {count} items, over its bound of {bound} (max_items in ps.proto)"


class Bounds:
    """The checks of one message type, built from its descriptor."""

    __slots__ = ("name", "least", "_texts", "_blobs", "_counts", "_each_text", "_one", "_each", "_nested")

    def __init__(self, descriptor: Descriptor) -> None:
        self.name = descriptor.name
        self.least = _UNBOUNDED  # the smallest bound in the type, nested types included
        self._texts: tuple[tuple[str, int], ...] = ()  # singular strings: (name, max_bytes)
        self._blobs: tuple[tuple[str, int], ...] = ()  # singular bytes: (name, max_bytes)
        self._counts: tuple[tuple[str, int], ...] = ()  # repeated fields: (name, max_items)
        self._each_text: tuple[tuple[str, int], ...] = ()  # repeated strings or bytes: (name, each one's max_bytes)
        self._one: tuple[tuple[str, Bounds], ...] = ()  # singular messages with bounded fields
        self._each: tuple[tuple[str, Bounds], ...] = ()  # repeated messages with bounded fields
        self._nested = False  # whether it has checks beyond singular strings and counts (`holds` leaves those)
        _BUILT[descriptor.full_name] = self  # before the nested types: a recursive type finds itself
        texts: list[tuple[str, int]] = []
        blobs: list[tuple[str, int]] = []
        counts: list[tuple[str, int]] = []
        each_text: list[tuple[str, int]] = []
        one: list[tuple[str, Bounds]] = []
        each: list[tuple[str, Bounds]] = []
        for field in descriptor.fields:
            max_bytes, max_items = declared(field)
            if field.is_repeated and max_items is not None:
                counts.append((field.name, max_items))
            if field.type in (_STRING, _BYTES) and max_bytes is not None:
                if field.is_repeated:
                    each_text.append((field.name, max_bytes))
                else:
                    (texts if field.type == _STRING else blobs).append((field.name, max_bytes))
            elif field.type == _MESSAGE:
                nested = bounds_of(field.message_type)
                if nested:
                    (each if field.is_repeated else one).append((field.name, nested))
        self._texts, self._blobs, self._counts = tuple(texts), tuple(blobs), tuple(counts)
        self._each_text, self._one, self._each = tuple(each_text), tuple(one), tuple(each)
        self._nested = bool(blobs or each_text or one or each)
        bounds = [b for _, b in (*texts, *blobs, *counts, *each_text)] + [n.least for _, n in (*one, *each)]
        self.least = min(bounds, default=_UNBOUNDED)

    def __bool__(self) -> bool:
        """Whether the type holds any bounded field, itself or in a nested message."""
        return self.least < _UNBOUNDED

    def holds(self, message: Any, size: int = _UNBOUNDED) -> bool:
        """Whether every field of `message` is within its bound (the fast path: no names, no paths).

        `size` is the message's encoded size when known: no field of it holds that many bytes or items (each
        takes a tag byte besides its own), so only bounds under it are looked at, and a message smaller than
        every bound of its type (a Join, a Heartbeat) is not looked at at all."""
        if size <= self.least:
            return True
        for name, bound in self._texts:
            if size > bound:
                text = getattr(message, name)
                # Within the bound in characters and ASCII: within it in bytes (the usual case, no encoding).
                if len(text) > bound or (not text.isascii() and utf8_length(text) > bound):
                    return False
        for name, bound in self._counts:
            if size > bound and len(getattr(message, name)) > bound:
                return False
        return not self._nested or self.find(message, size) is None

    def find(self, message: Any, size: int = _UNBOUNDED) -> Found | None:
        """The first field of `message` past its bound, with its path and what is wrong, or None. Counts come
        before elements: a field of a million items is refused before any of them is read."""
        if size <= self.least:
            return None
        for name, bound in self._texts:
            if size > bound:
                length = utf8_length(getattr(message, name))
                if length > bound:
                    return name, _over_bytes(length, bound)
        for name, bound in self._blobs:
            if size > bound and len(getattr(message, name)) > bound:
                return name, _over_bytes(len(getattr(message, name)), bound)
        for name, bound in self._counts:
            if size > bound and len(getattr(message, name)) > bound:
                return name, _over_items(len(getattr(message, name)), bound)
        for name, bound in self._each_text:
            if size > bound:
                for i, item in enumerate(getattr(message, name)):
                    length = len(item) if isinstance(item, bytes) else utf8_length(item)
                    if length > bound:
                        return f"{name}[{i}]", _over_bytes(length, bound)
        for name, nested in self._one:
            if size > nested.least and message.HasField(name):
                found = nested.find(getattr(message, name), size)
                if found is not None:
                    return f"{name}.{found[0]}", found[1]
        for name, nested in self._each:
            if size > nested.least:
                for i, item in enumerate(getattr(message, name)):
                    found = nested.find(item, size)
                    if found is not None:
                        return f"{name}[{i}].{found[0]}", found[1]
        return None


_BUILT: dict[str, Bounds] = {}


def bounds_of(descriptor: Descriptor) -> Bounds:
    """The checks of a message type (built on first use, then kept)."""
    built = _BUILT.get(descriptor.full_name)
    return built if built is not None else Bounds(descriptor)


# The checks of every message type of ps.proto by class, built at import: no request pays for building them.
_BY_CLASS: dict[type, Bounds] = {
    getattr(ps_pb2, name): bounds_of(descriptor) for name, descriptor in ps_pb2.DESCRIPTOR.message_types_by_name.items()
}


def check(message: Message, rpc: str, size: int = _UNBOUNDED) -> None:
    """Raise OutOfBounds, naming the RPC, the field and its bound, if a field of `message` is past its bound.
    `size`: the length of the bytes it was parsed from, when known (it spares most checks, see Bounds.holds)."""
    bounds = _BY_CLASS.get(type(message))
    if bounds is None:
        bounds = bounds_of(message.DESCRIPTOR)
    if not bounds.holds(message, size):
        raise _out_of_bounds(bounds, message, rpc)


def _out_of_bounds(bounds: Bounds, message: Message, rpc: str) -> OutOfBounds:
    field, problem = bounds.find(message) or ("?", "is past its bound")
    return OutOfBounds(f"{rpc}: {bounds.name}.{field} {problem}")


def _undecodable(raw: bytes, message: type[Message], rpc: str, exc: Exception) -> Undecodable:
    kind = message.DESCRIPTOR
    return Undecodable(
        f"{rpc}: {len(raw)} bytes that are not a valid protobuf message of type {kind.full_name} ({exc}); "
        f"send a {kind.name} serialized as ps.proto defines it"
    )


def decoder(message: type[M], rpc: str) -> Callable[[bytes], M]:
    """The decoder of an RPC's requests: parse, then check the bounds (Undecodable, OutOfBounds)."""
    parse = message.FromString
    bounds = bounds_of(message.DESCRIPTOR)
    holds = bounds.holds

    def decode(raw: bytes) -> M:
        try:
            parsed = parse(raw)
        except DecodeError as exc:
            raise _undecodable(raw, message, rpc, exc) from None
        if not holds(parsed, len(raw)):
            raise _out_of_bounds(bounds, parsed, rpc)
        return parsed

    return decode


def stream_decoder(message: type[M], rpc: str) -> Callable[[bytes], codec.Chunk | M]:
    """The decoder of a client stream's messages: a Chunk by codec's fast path, unchecked (it holds no bounded
    field), anything else (a header) parsed by protobuf and checked (Undecodable, OutOfBounds)."""
    bounds = bounds_of(message.DESCRIPTOR)

    def decode(raw: bytes) -> codec.Chunk | M:
        try:
            parsed = codec.decode(raw, message)
        except DecodeError as exc:
            raise _undecodable(raw, message, rpc, exc) from None
        if not isinstance(parsed, codec.Chunk) and not bounds.holds(parsed, len(raw)):
            raise _out_of_bounds(bounds, parsed, rpc)
        return parsed

    return decode
