"""Reaching a job: the first contact with any one shard (which may still be starting), the topology it tells,
and a ShardLink to every shard (to each copy, with replicas), on channels with the session's credentials."""

from __future__ import annotations

from concurrent import futures

import grpc

from paramserver.security import open_channel
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker.client.channels import REPLICA_KEEPALIVE, channel_options, first_contact
from worker.client.link import Session, ShardLink


def connect_links(
    address: str,
    session: Session,
    credentials: grpc.ChannelCredentials | None,
    auth_token: str | None,
    connect_timeout: float,
) -> tuple[ps_pb2.Topology, tuple[ShardLink, ...], futures.ThreadPoolExecutor]:
    """Ask `address` for the job's topology (waiting up to `connect_timeout` for it to answer), then open a link
    to every shard; return the topology, the links and the thread pool they share (one thread a shard)."""
    options = channel_options()
    if session.tls_server_name:
        options.append(("grpc.ssl_target_name_override", session.tls_server_name))
    # The channel's own retries would keep each try at a refused address going for seconds, unsaid.
    no_retries = [(k, v) for k, v in options if k != "grpc.enable_retries"] + [("grpc.enable_retries", 0)]
    entry = open_channel(address, no_retries, credentials, auth_token)
    try:
        topo = first_contact(ps_pb2_grpc.ParameterServerStub(entry), address, connect_timeout)
    finally:
        entry.close()
    addresses = list(topo.shards)
    pool = futures.ThreadPoolExecutor(max_workers=len(addresses), thread_name_prefix="ps-client")
    copies = len(topo.replicas) // len(addresses) if topo.replicas else 1
    if copies > 1:
        # A shard's copy that is not its primary answers UNAVAILABLE at once: the link tries the other copy
        # (ShardLink.retry), where the channel's own retries would keep asking the same one. HTTP/2 pings
        # every second end a call to a copy that went silent (cut off, or its host gone) within about 2 s,
        # as UNAVAILABLE, so the link turns to the other copy, which took over meanwhile.
        options = no_retries + REPLICA_KEEPALIVE

    def connect(shard: str) -> grpc.Channel:
        return open_channel(shard, options, credentials, auth_token)

    links = tuple(
        ShardLink(k, a, connect(a), session, pool, tuple(topo.replicas[k * copies : (k + 1) * copies]), connect)
        for k, a in enumerate(addresses)
    )
    return topo, links, pool
