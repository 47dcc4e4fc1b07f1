"""Ray connection: import Ray (an optional extra) with an error that says how to install it, join or start a
cluster, and name this process's node. Used by the Ray env workers (``streamrl.envs.ray_workers``), the Ray
generation engines (``streamrl.agents.ray_engines``) and the Ray learner ranks
(``streamrl.algorithms.ray_ranks``).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

__all__ = ["WORKER_NICENESS", "connect", "local_ray_options", "node_address", "require_ray"]

_INSTALL_HINT = "Ray is not installed: install the `ray` extra (`pip install 'streamrl[ray]'`, Ray 2.60.0)"


def require_ray() -> ModuleType:
    """The ``ray`` module, or an ``ImportError`` that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(f"{_INSTALL_HINT} (import failed: {exc})") from exc
    return ray


def connect(address: str | None = None) -> bool:
    """Join the Ray cluster at ``address`` (``ray.init``) unless this process already has; ``None`` starts a
    local instance (or joins the one ``RAY_ADDRESS`` names). Returns whether this call connected, i.e.
    whether the caller owns the connection (and should ``ray.shutdown()`` when done)."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, logging_level="WARNING", **local_ray_options(address))
    return True


WORKER_NICENESS = 0
"""The niceness of the Ray workers (actors) of a Ray instance streamrl starts. Ray's default, 15, gives an actor
a few percent of a core next to a busy process at the default 0 -- the trainer, on the same node -- and an
ALFWorld env actor then steps many times slower than a worker process (``docs/scaling.md``, Priority). For a
cluster started with ``ray start``, set ``RAY_worker_niceness=0`` in its environment (``docs/scaling.md``)."""


def local_ray_options(address: str | None = None) -> dict[str, Any]:
    """``ray.init`` options for a Ray instance this process starts (``address`` and ``RAY_ADDRESS`` unset):
    workers at ``WORKER_NICENESS``. Empty when joining an existing cluster, whose settings are its own."""
    if address is not None or os.environ.get("RAY_ADDRESS"):
        return {}
    return {"_system_config": {"worker_niceness": WORKER_NICENESS}}


def node_address() -> str:
    """This process's node as Ray names it (the IP address of the node it runs on)."""
    ray = require_ray()
    return str(ray.util.get_node_ip_address())
