"""Typed errors of the parameter server and the one table that maps them to gRPC status codes.

Each type carries its status code; `status_of` is the one place an exception becomes the status a shard answers
(the code, the type to name, the details), used by the gRPC servicer (`rpc_errors`), the token check
(paramserver.security) and the doorbell and data socket (paramserver.transport.socket_server). The client turns
statuses back into these types (`from_rpc_error`, `from_status`), so both sides speak of the same failures by name.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import NamedTuple, NoReturn

import grpc

log = logging.getLogger(__name__)


class PSError(Exception):
    """Base of every error the parameter server reports."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    # False for an error a client made of a status no shard named (gRPC's own: a deadline that ran out on a call
    # nothing answered, a connection that failed): the shard may never have seen the call.
    named_by_server: bool = True


class InvalidArgument(PSError):
    """A request is malformed: wrong shape, size or dtype, unknown piece, bad chunk, NaN or Inf."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ShapeMismatch(InvalidArgument):
    """A tensor's shape or size differs from what the shard holds."""


class UnknownTensor(InvalidArgument):
    """A name or piece that the model does not have."""


class MalformedStream(InvalidArgument):
    """Chunks that overlap, leave a gap, run out of range or are cut short."""


class NonFiniteGradient(InvalidArgument):
    """A gradient holding NaN or Inf."""


class Undecodable(InvalidArgument):
    """Bytes that are no valid protobuf message of the type the RPC (or frame) takes."""


class OutOfBounds(InvalidArgument):
    """A field past the bound ps.proto declares for it (max_bytes, max_items)."""


class FailedPrecondition(PSError):
    """The shard is not in a state where this request makes sense."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ModelMismatch(FailedPrecondition):
    """A different model (digest) than the one the shard holds."""


class NotInitialized(FailedPrecondition):
    """A push or pull before any worker registered the model."""


class WrongJob(FailedPrecondition):
    """A worker that names another job."""


class OtherDataset(FailedPrecondition):
    """A claim naming another dataset than the one the job follows (ps-worker --follow)."""


class NotClaimShard(FailedPrecondition):
    """A claim sent to a shard that does not keep the job's claims (shard 0 does)."""


class SharedMemoryUnavailable(FailedPrecondition):
    """The shard cannot use an offered shared-memory segment (another host, or disabled): use the streams."""


class DataSocketUnavailable(FailedPrecondition):
    """The shard serves no data socket (--no-data-socket): use the streams."""


class NotAttached(FailedPrecondition):
    """An Exchange from a worker with no segment attached for this model (e.g. the shard restarted): attach again."""


class AlreadyInitialized(PSError):
    """Init of the very model the shard already holds: the worker should pull instead."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Aborted(PSError):
    """The request lost a race with the job's progress; the worker should catch up and go on."""

    code = grpc.StatusCode.ABORTED


class StaleRound(Aborted):
    """A push for a round that has already closed: the worker should pull again."""


class UnknownWorker(Aborted):
    """A worker the shard does not know (never joined, left or was evicted): it should join again."""


class ClaimNotHeld(Aborted):
    """A finish of a dataset shard the worker does not hold (its claim was released): the shard is trained again
    by whoever claims it next; the worker claims another."""


class PullTimeout(PSError):
    """A pull that waited past its deadline for the version it asked for."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class TooLarge(PSError):
    """A message or model over the configured limits, or a job already full."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class JobFull(TooLarge):
    """A Join when the job already has its number of live workers (one may be a dead worker whose lease runs)."""


class ShuttingDown(PSError):
    """The shard is stopping; retry against it once it is back."""

    code = grpc.StatusCode.UNAVAILABLE


class NotPrimary(PSError):
    """This process holds a copy of the shard's part but is not its primary (a backup, or a primary that was
    deposed): the worker goes to the part's other copy."""

    code = grpc.StatusCode.UNAVAILABLE


class InitInProgress(ShuttingDown):
    """Another worker is initialising the shard right now: retry shortly (then the model is held: pull it)."""


class Unreachable(PSError):
    """Nothing answers at a shard's address (connection refused, unknown host, no route): is it running there?"""

    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(PSError):
    """Missing or wrong credentials."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(PSError):
    """A doorbell or data-socket connection speaking for another worker than the one it proved in its hello."""

    code = grpc.StatusCode.PERMISSION_DENIED


# The servicer names the exact error type in this trailing-metadata key, so the client raises that very type
# (`except UnknownWorker` vs `except StaleRound`); a client in another language can rely on the status alone.
ERROR_KEY = "ps-error"

# Client side, when no type is named: the most general type for each status.
_BY_CODE: dict[grpc.StatusCode, type[PSError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyInitialized,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.DEADLINE_EXCEEDED: PullTimeout,
    grpc.StatusCode.RESOURCE_EXHAUSTED: TooLarge,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


class RemoteError(PSError):
    """A status from a shard that has no more specific type (UNAVAILABLE, INTERNAL, ...)."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


def _error_types() -> dict[str, type[PSError]]:
    found: dict[str, type[PSError]] = {}
    todo: list[type[PSError]] = [PSError]
    while todo:
        cls = todo.pop()
        if cls is not RemoteError:
            found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


def from_rpc_error(err: grpc.RpcError, shard: str = "") -> PSError:
    """Turn a gRPC error from a shard into the matching PSError, keeping the server's message."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    detail = err.details() if hasattr(err, "details") else str(err)
    named = dict(err.trailing_metadata() or ()).get(ERROR_KEY) if hasattr(err, "trailing_metadata") else None
    return from_status(code, detail, named, shard)


def from_status(code: grpc.StatusCode, detail: str, named: str | None = None, shard: str = "") -> PSError:
    """The PSError for a status from a shard: the type it named when that type has this code, else by code."""
    where = f"shard {shard}: " if shard else ""
    kind = _error_types().get(named) if named else None
    if kind is None or kind.code != code:
        kind = _BY_CODE.get(code)
    if kind is None:
        return RemoteError(f"{where}{code.name}: {detail}", code)
    out = kind(f"{where}{detail}")
    out.code = code
    out.named_by_server = named is not None
    return out


class Status(NamedTuple):
    """What a shard answers for a refused or failed request."""

    code: grpc.StatusCode
    name: str  # the PSError type the client should raise (ERROR_KEY, or the frame's type name); "": by code alone
    details: str


def status_of(exc: BaseException, what: str) -> Status:
    """The status for an exception raised while serving `what` (an RPC's name): a PSError's own code and type;
    anything else INTERNAL, naming no type (the client cannot have caused it)."""
    if isinstance(exc, PSError):
        return Status(exc.code, type(exc).__name__, str(exc))
    return Status(grpc.StatusCode.INTERNAL, "", f"{what} failed on the server: {type(exc).__name__}: {exc}")


def abort(context: grpc.ServicerContext, status: Status) -> NoReturn:
    """End an RPC with `status`, naming its type in the ERROR_KEY trailing metadata when it has one."""
    if status.name:
        context.set_trailing_metadata(((ERROR_KEY, status.name),))
    context.abort(status.code, status.details)
    raise AssertionError("unreachable: ServicerContext.abort raises")  # for type checkers: abort never returns


@contextlib.contextmanager
def rpc_errors(
    context: grpc.ServicerContext, rpc: str, on_reject: Callable[[PSError], None] | None = None
) -> Iterator[None]:
    """Map PSError to its status and anything unexpected to INTERNAL (logged), for one RPC."""
    try:
        yield
    except PSError as exc:
        log.info("%s rejected: %s: %s", rpc, exc.code.name, exc)
        if on_reject is not None:
            on_reject(exc)
        abort(context, status_of(exc, rpc))
    except Exception as exc:  # noqa: BLE001 - the boundary: never leak a traceback to the client
        if not context.is_active():  # the call already ended (cancelled, or refused by gRPC itself)
            log.debug("%s ended early: %s", rpc, exc)
        else:
            log.exception("%s failed", rpc)
        abort(context, status_of(exc, rpc))
