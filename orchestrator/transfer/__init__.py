"""Embedding handoff from the encoder (producer) to prefill (consumer).

Import from here; the transports themselves (``nixl``, ``inline``) load on first use.
"""

from orchestrator.transfer.base import (
    ConsumerConfig,
    EmbeddingConsumer,
    EmbeddingProducer,
    PoolFullError,
    ProducerConfig,
    ProducerStats,
    make_consumer,
    make_producer,
    pool_bytes_for,
)

__all__ = [
    "ConsumerConfig",
    "EmbeddingConsumer",
    "EmbeddingProducer",
    "PoolFullError",
    "ProducerConfig",
    "ProducerStats",
    "make_consumer",
    "make_producer",
    "pool_bytes_for",
]
