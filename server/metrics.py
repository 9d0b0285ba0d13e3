"""Prometheus metrics of the HTTP front end, vLLM-style names under the `pdserve:` prefix.

Each app gets its own `CollectorRegistry` (never the process-global one), so tests can build
many apps in one process. Request-level series are observed by the server as requests stream;
per-instance gauges and engine counters are read from `client.instances()` at scrape time.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.types import FinishReason
from server.protocol import InstanceInfo

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


def metric_name(key: str) -> str:
    """`pdserve:<key>` with anything Prometheus does not allow replaced by `_`."""
    name = re.sub(r"[^a-zA-Z0-9_:]", "_", key)
    if not name or name[0].isdigit():
        name = "_" + name
    return "pdserve:" + name


class _InstanceCollector:
    """Per-instance gauges and engine counters, read from the client when scraped."""

    def __init__(self, instances: Callable[[], list[InstanceInfo]],
                 counters: Callable[[], dict[str, float]] | None = None) -> None:
        self._instances = instances
        self._counters = counters

    def describe(self):
        return []  # dynamic: do not let the registry call collect() at registration time

    def collect(self):
        try:
            infos = list(self._instances())
        except Exception:  # a scrape must never fail because one engine is unreachable
            logger.exception("instances() failed during a metrics scrape")
            infos = []
        gauges = {
            "num_requests_running": ("Requests in the engine's running batch.", lambda i: i.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", lambda i: i.num_waiting),
            "kv_blocks_free": ("Free KV cache blocks.", lambda i: i.kv_blocks_free),
            "kv_blocks_total": ("KV cache blocks in total.", lambda i: i.kv_blocks_total),
            "kv_cache_usage_perc": ("KV cache usage; 1 means 100 percent.",
                                    lambda i: 1.0 - i.kv_blocks_free / i.kv_blocks_total if i.kv_blocks_total else 0.0),
            "instance_ready": ("1 when the instance is ready to serve.", lambda i: 1.0 if i.ready else 0.0),
            "instance_stalled": ("1 while the instance runs a step far longer than its recent ones.",
                                 lambda i: 1.0 if i.state == "stalled" else 0.0),
            "instance_step_running_seconds": ("How long the instance's step in progress has been running.",
                                              lambda i: i.step_running_s),
        }
        for key, (doc, value) in gauges.items():
            family = GaugeMetricFamily(metric_name(key), doc, labels=["instance", "role"])
            for info in infos:
                family.add_metric([info.name, info.role], float(value(info)))
            yield family
        yield from _engine_counters(infos)
        own = dict.fromkeys(FRONT_END_COUNTERS, 0.0) | (self._counters() if self._counters else {})
        for key, val in own.items():  # the front end's own
            family = CounterMetricFamily(metric_name(key), FRONT_END_COUNTERS.get(key, f"Front end counter {key}."))
            family.add_metric([], float(val))
            yield family


# The router client's own counters (its `counters()` keys), exported as 0 until they first count:
# the Grafana dashboard (deploy/grafana/) and alerts are written against them.
FRONT_END_COUNTERS = {
    "requests_resumed_total": "Requests resumed on another instance after theirs died mid-stream.",
    "requests_retried_total": "Requests prefilled again after a failure before their first token.",
    "requests_failed_after_resume_total": "Resumed requests that still ended in an error.",
    "requests_prefilled_on_decode_total": "PD requests prefilled on their decode instance (prefill was queued up).",
    "engine_connections_refused": "Connections to the engine socket refused at the handshake (cluster key).",
    "engines_declared_dead_total": "Engines declared dead (no heartbeat for --dead-after-s, or stalled too long).",
    "engine_stalls_total": "Times an engine was seen stalled (a step far longer than its recent ones).",
    "pd_pair_breaker_trips_total": "Times a P->D pair was avoided after its KV transfers kept failing.",
    "engine_restarts_total": "Engine processes `pdserve serve` started again after they exited unexpectedly.",
}


# Indexed counters are labelled `position` (the draft position) unless named here.
INDEX_LABELS = {"spec_decode_num_steps_by_k_total": "k"}  # steps by the number of drafts chosen


def _engine_counters(infos: list[InstanceInfo]) -> list[CounterMetricFamily]:
    """One family per engine counter; indexed counters get a `position` (or `k`) label."""
    families: dict[str, CounterMetricFamily] = {}

    def family(key: str, labels: list[str]) -> CounterMetricFamily:
        name = metric_name(key)
        if name not in families:
            families[name] = CounterMetricFamily(name, f"Engine counter {key}.", labels=labels)
        return families[name]

    for info in infos:
        for key, val in (info.counters or {}).items():
            family(key, ["instance", "role"]).add_metric([info.name, info.role], float(val))
        for key, values in (info.per_position or {}).items():
            for pos, val in enumerate(values):
                label = INDEX_LABELS.get(key, "position")
                family(key, ["instance", "role", label]).add_metric([info.name, info.role, str(pos)], float(val))
    return list(families.values())


class ServerMetrics:
    def __init__(self, instances: Callable[[], list[InstanceInfo]],
                 counters: Callable[[], dict[str, float]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve:inter_token_latency_seconds", "Time between streamed token chunks.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.handoff = Histogram("pdserve:pd_handoff_seconds",
                                 "PD: time from the prefill's first token to the decode's first tokens.",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("pdserve:request_queue_time_seconds",
                                    "Time a request waited before it was scheduled.", buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter("pdserve:request_success", "Finished requests, by finish reason.",
                                       ["finished_reason"], registry=r)
        self.request_errors = Counter("pdserve:request_errors", "Requests that failed inside the engine.", registry=r)
        self.http_rejected = Counter("pdserve:http_requests_rejected", "HTTP requests refused, by status code.",
                                     ["status"], registry=r)
        self.slow_reader_aborts = Counter("pdserve:streams_aborted_slow_reader",
                                          "Streams aborted because their client stopped reading (backlog bound).",
                                          registry=r)
        for reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT):
            self.request_success.labels(finished_reason=reason)
        r.register(_InstanceCollector(instances, counters))

    def render(self) -> bytes:
        return generate_latest(self.registry)
