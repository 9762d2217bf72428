"""The kera producer: `Producer.send` / `send_batch` / `flush` (source side + request thread)."""

from kera.producer.producer import Producer

__all__ = ["Producer"]
