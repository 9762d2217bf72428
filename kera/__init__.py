"""kera: stream storage with shared virtual logs.

    from kera import Admin, Producer, Consumer
"""

from kera.errors import KeraError
from kera.codec.position import Position, Record

__all__ = ["Admin", "Producer", "Consumer", "KeraError", "Position", "Record"]


def _beside_a_checkout() -> None:
    """Imported from a source checkout without installing (a Spark worker started in the
    repository folder finds this folder first): find the subpackages that live beside it
    (broker/, producer/, ...) there, as the installed package maps them (pyproject package-dir)."""
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "pyproject.toml")) and \
            os.path.isdir(os.path.join(root, "producer")) and root not in __path__:
        __path__.append(root)


_beside_a_checkout()
__version__ = "0.1.0"


def __getattr__(name):
    # Imported lazily so that `import kera` (e.g. in a daemon) does not load the clients.
    if name == "Admin":
        from kera.client.admin import Admin
        return Admin
    if name == "Producer":
        from kera.producer import Producer
        return Producer
    if name == "Consumer":
        from kera.consumer import Consumer
        return Consumer
    raise AttributeError(f"module 'kera' has no attribute {name!r}")
