"""paramserver: a parameter server for PyTorch data-parallel training over gRPC.

Public API: `ServerConfig`, `LocalCluster` (and the `ps_cluster` pytest fixture in `paramserver.testing`).
Imports stay lazy so `import paramserver` is cheap and pulls in neither torch nor grpc until needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LocalCluster", "ServerConfig", "__version__"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from paramserver.config import ServerConfig
    from paramserver.server.cluster import LocalCluster


def __getattr__(name: str) -> Any:
    if name == "LocalCluster":
        from paramserver.server.cluster import LocalCluster

        return LocalCluster
    if name == "ServerConfig":
        from paramserver.config import ServerConfig

        return ServerConfig
    raise AttributeError(f"module 'paramserver' has no attribute {name!r}")
