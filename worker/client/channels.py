"""How a worker reaches the shards: the options of its gRPC channels, and its first contact with a shard that may
still be starting."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import grpc

from paramserver.errors import Unreachable, from_rpc_error
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker.client.link import CONNECT_S

log = logging.getLogger(__name__)

# Unary calls retry UNAVAILABLE (a shard restarting) with backoff, declared once for the channel. Streams are
# retried by ShardLink.retry instead; a push is safe to resend because the server dedupes (worker, step).
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                # Unary calls only: gRPC's own retry of a server stream (Pull) waiting when its shard dies was
                # seen to never return, not even at its deadline. Streams are retried by ShardLink.retry.
                "name": [
                    {"service": "paramserver.v1.ParameterServer", "method": m}
                    for m in ("GetTopology", "Join", "Leave", "Heartbeat", "Attach")
                ],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

# Channel options of a worker's links to the copies of replicated shards (see PSClient): pings even while a call
# waits for its answer, a second apart, and a second to answer each (the shards accept pings that often).
REPLICA_KEEPALIVE: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

# The first contact with a shard that does not answer (not started yet, or a wrong address): tried again after
# this long, then twice as long each time up to the cap, each try logged, until PSClient's connect_timeout.
CONNECT_RETRY_S = 1.0
CONNECT_RETRY_MAX_S = 5.0


def channel_options(max_message_bytes: int = 4 * 1024 * 1024 + 4096) -> list[tuple[str, Any]]:
    """Options of every channel the client opens."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.enable_retries", 1),
        # Reconnect fast after a short outage, so heartbeats resume well within a lease.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.service_config", _SERVICE_CONFIG),
    ]


def first_contact(stub: ps_pb2_grpc.ParameterServerStub, address: str, limit: float) -> ps_pb2.Topology:
    """Ask the shard at `address` for the topology, asking again while nothing answers there (it may still be
    starting), with a warning per try that says why and when the worker gives up; Unreachable after `limit` s.

    No wait_for_ready: with it a refused connection is silent until the deadline, and then reads as a timeout."""
    began = time.monotonic()
    delay, why = CONNECT_RETRY_S, ""
    while True:
        left = began + limit - time.monotonic()
        try:
            return stub.GetTopology(ps_pb2.GetTopologyRequest(), timeout=max(min(CONNECT_S, left), 0.1))
        except grpc.RpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise from_rpc_error(err, address) from None
            # A try cut short by the give-up time says less than the refusal before it.
            if err.code() == grpc.StatusCode.UNAVAILABLE or not why:
                why = _why_unreachable(err)
        left = began + limit - time.monotonic()
        if left <= 0:
            raise Unreachable(
                f"cannot connect to {address} ({why}); gave up after {time.monotonic() - began:.0f} s: is ps-server "
                "running there, and is the address right?"
            )
        wait = min(delay, left)
        log.warning("cannot connect to %s (%s); trying again in %.1f s, giving up in %.0f s", address, why, wait, left)
        time.sleep(wait)
        delay = min(2 * delay, CONNECT_RETRY_MAX_S)


def _why_unreachable(err: grpc.RpcError) -> str:
    """The reason in a failed connection's status, as a person would say it ("connection refused")."""
    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "no answer in time"
    detail = (err.details() or "").strip() if hasattr(err, "details") else ""
    reason = detail.rsplit(": ", 1)[-1].strip(" []()") if detail else ""
    reason = reason or "unavailable"
    return reason[:1].lower() + reason[1:]
