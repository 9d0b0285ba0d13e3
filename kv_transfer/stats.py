"""Counters of the KV transfer, exported through the engine heartbeat into /metrics."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_sent: int = 0
    transfers_received: int = 0
    transfers_failed: int = 0
    leases_expired: int = 0
    dropped_frames: int = 0          # malformed or unauthenticated
    handshakes_rejected: int = 0
    latency_seconds_sum: float = 0.0  # D: pull request -> KV in place
    latency_seconds_count: int = 0

    def as_counters(self) -> dict[str, float]:
        return {f"kv_transfer_{k}": float(v) for k, v in asdict(self).items()}
