"""Fixtures that more than one test module uses, defined where they were first needed.

- `raw` (tests/test_shared_memory.py): a one-shard async job holding a 15-element model, with WORKER and OTHER
  joined through a raw gRPC stub;
- `pki` (tests/test_security_metrics.py): a CA, a shard certificate for 127.0.0.1 and client certificates.
"""

from test_security_metrics import pki  # noqa: F401
from test_shared_memory import raw  # noqa: F401
