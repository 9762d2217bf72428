"""The coordinator: cluster membership, stream metadata and placement.

`core.Coordinator` is the sans-IO state machine, `store` persists it, `server` is the daemon.
"""

from kera.coordinator.core import Coordinator

__all__ = ["Coordinator"]
