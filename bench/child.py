"""Entry point of every benchmark child process: `python -m bench.child MODULE ROLE PARAMS_JSON`.

The role runs from the imported module `bench.MODULE` (never from `__main__`), so functions that travel by
reference, such as torch.distributed.rpc's remote functions, resolve to the same module on both sides.
"""

from __future__ import annotations

import importlib
import json
import sys

from bench.common import child_main


def main(argv: list[str]) -> int:
    """Import bench.MODULE and run its ROLES[ROLE] with the JSON parameters."""
    module, role, params = argv[0], argv[1], json.loads(argv[2]) if len(argv) > 2 else {}
    roles = importlib.import_module(f"bench.{module}").ROLES
    return child_main(roles, role, params)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
