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
    transfers_invalid: int = 0       # D: the expected transfer's header or frames failed validation
    checksum_mismatches: int = 0     # D: ... because the payload's checksum did not match
    leases_expired: int = 0
    reservations_expired: int = 0    # D: no blocks for the prompt within the reservation deadline
    dropped_frames: int = 0          # malformed or unauthenticated
    dropped_unexpected: int = 0      # well-formed, for a transfer not expected (old attempt, other P, unknown)
    handshakes_rejected: int = 0
    transfers_resumed: int = 0       # D: pulls asked for again after a reconnect or a silence; P: resends
    transfers_stalled: int = 0       # D: pulls given up after --kv-deadline-s without progress
    reconnects: int = 0              # D: KV connections to a prefill that came back after a break
    # D: P sending the first KV byte -> the last one landing here (not the prefill before it); every
    # byte is counted once on each side (hidden states included), resends again on P's.
    latency_seconds_sum: float = 0.0
    latency_seconds_count: int = 0
    layers_received: int = 0         # D: layer-wise messages written into KV memory
    handoff_seconds_sum: float = 0.0  # D: P done with the last KV layer's forward -> the first step here
    handoff_seconds_count: int = 0

    def as_counters(self) -> dict[str, float]:
        return {f"kv_transfer_{k}": float(v) for k, v in asdict(self).items()}
