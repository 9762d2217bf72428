"""The Kafka wire-protocol listener: one module per group of Kafka APIs, over the broker's core."""
