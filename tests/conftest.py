"""Fixtures that more than one test module uses (what they stand on is in tests/support/).

- `raw`: a one-shard async job holding a 15-element model, with WORKER and OTHER joined through a raw gRPC stub
  (support/raw_job.py);
- `pki`: a CA, a shard certificate for 127.0.0.1 and client certificates (paramserver.testing.make_pki), one set
  per module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.raw_job import Raw, raw_job

from paramserver.server.cluster import LocalCluster
from paramserver.testing import make_pki


@pytest.fixture
def raw(ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path) -> Iterator[Raw]:
    with raw_job(ps_cluster_factory, tmp_path) as job:
        yield job


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, a shard certificate for 127.0.0.1/localhost, a client certificate, and a client from another CA."""
    return make_pki(tmp_path_factory.mktemp("pki"))
