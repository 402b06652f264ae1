"""One operation on every shard at once: begun on each link, then waited for, each failure retried on its own shard
(worker.client.link.ShardLink.retry), the first that remains raised once all have finished."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import TypeVar

from paramserver.errors import PSError
from worker.client.link import ShardLink
from worker.client.transports import CALLER_SHARD

T = TypeVar("T")


def _begin_and_wait(start: Callable[[ShardLink], Callable[[], T]], link: ShardLink) -> T:
    return start(link)()


def fan_out(
    links: Sequence[ShardLink],
    start: Callable[[ShardLink], Callable[[], T]],
    meanwhile: Callable[[], object] | None = None,
) -> list[T]:
    """Run an operation on these shards at once: `start(link)` begins it and returns a function that waits for its
    result. A shard that fails is then retried on its own (see ShardLink.retry); the first failure that remains is
    raised, once every shard has finished. `meanwhile` runs in this thread once all have begun (backward, while
    the pushes go): if it raises, that is raised once every shard has finished (or failed)."""
    waits: list[Callable[[], T] | PSError] = [PSError()] * len(links)
    # The caller's shard last (its part runs in this thread: transports.CALLER_SHARD), the others under way first.
    for k in sorted(reversed(range(len(links))), key=lambda k: links[k].index == CALLER_SHARD):
        try:
            waits[k] = links[k].call(functools.partial(start, links[k]))
        except PSError as exc:
            waits[k] = exc
    if meanwhile is not None:
        try:
            meanwhile()
        except BaseException:
            for wait in waits:
                if not isinstance(wait, PSError):
                    with contextlib.suppress(Exception):
                        wait()  # each ends soon: its push stops where backward did
            raise
    results: list[T] = []
    error: PSError | None = None
    for link, wait in zip(links, waits, strict=True):
        try:
            if isinstance(wait, PSError):
                raise wait
            results.append(link.call(wait))
        except PSError as exc:
            try:
                results.append(link.retry(functools.partial(_begin_and_wait, start, link), failed=exc))
            except PSError as final:
                error = error or final
    if error is not None:
        raise error
    return results


def each(
    pool: futures.Executor, links: Sequence[ShardLink], fn: Callable[[ShardLink], T], rejoin: bool = True
) -> list[T]:
    """Run fn(link) for every link concurrently on `pool` (each with its retries); raise the first failure."""
    futs = [pool.submit(link.retry, functools.partial(fn, link), rejoin) for link in links]
    results, error = [], None
    for f in futs:
        try:
            results.append(f.result())
        except PSError as exc:
            error = error or exc
    if error is not None:
        raise error
    return results
