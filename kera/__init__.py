"""kera: stream storage with shared virtual logs.

    from kera import Admin, Producer, Consumer
"""

from kera.errors import KeraError
from kera.position import Position, Record

__all__ = ["Admin", "Producer", "Consumer", "KeraError", "Position", "Record"]
__version__ = "0.1.0"


def __getattr__(name):
    # Imported lazily so that `import kera` (e.g. in a daemon) does not load the clients.
    if name == "Admin":
        from kera.admin import Admin
        return Admin
    if name == "Producer":
        from kera.producer import Producer
        return Producer
    if name == "Consumer":
        from kera.consumer import Consumer
        return Consumer
    raise AttributeError(f"module 'kera' has no attribute {name!r}")
