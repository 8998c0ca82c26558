"""DeepSpec: a reproducible replication of DSpark (confidence-scheduled
speculative decoding with semi-autoregressive drafters)."""

__version__ = "0.1.0"
