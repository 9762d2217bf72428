"""The kera consumer: `Consumer` (request thread + the caller's iteration) and its `Batch`."""

from kera.consumer.batch import Batch
from kera.consumer.consumer import Consumer

__all__ = ["Batch", "Consumer"]
