"""Request log lines and Prometheus metrics of ``ferrule serve``.

One log line per operation when it finishes (logger ``ferrule.serve``, INFO)::

    op=forward_backward client=alice base=smollm2 model=sess-..:train:0 seq=3 data=8 tokens=412 queued_s=0.001 run_s=0.214 batch=1 status=ok

(``batch``: how many sampling requests shared one ``generate`` call; ``run_s`` is that call's time.)

Prometheus series (``prometheus_client``, one registry per app so several apps in one process
do not collide), served at ``GET /metrics``:

- ``ferrule_serve_http_requests_total{method,route,status}`` and
  ``ferrule_serve_http_request_seconds{method,route}`` (every HTTP request, polls included);
- ``ferrule_serve_ops_total{op,status}``, ``ferrule_serve_op_seconds{op}`` (run time of the
  operation in the worker), ``ferrule_serve_op_queue_seconds{op}``,
  ``ferrule_serve_tokens_total{op}``, ``ferrule_serve_data_total{op}``;
- ``ferrule_serve_deduplicated_total`` (retries answered with the first request's id),
  ``ferrule_serve_refused_total`` (requests refused on arrival, 4xx).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

__all__ = ["Telemetry"]

log = logging.getLogger("ferrule.serve")
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Telemetry:
    """Counters and histograms of one app, and the per-operation log line."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter("ferrule_serve_http_requests", "HTTP requests", ["method", "route", "status"],
                                     registry=r)
        self.http_seconds = Histogram("ferrule_serve_http_request_seconds", "HTTP request latency (seconds)",
                                      ["method", "route"], buckets=_BUCKETS, registry=r)
        self.ops = Counter("ferrule_serve_ops", "operations run by the worker", ["op", "status"], registry=r)
        self.op_seconds = Histogram("ferrule_serve_op_seconds", "operation run time (seconds)", ["op"],
                                    buckets=_BUCKETS, registry=r)
        self.queue_seconds = Histogram("ferrule_serve_op_queue_seconds", "time from submission to start (seconds)",
                                       ["op"], buckets=_BUCKETS, registry=r)
        self.tokens = Counter("ferrule_serve_tokens", "tokens in operations' inputs", ["op"], registry=r)
        self.data = Counter("ferrule_serve_data", "data (datums / samples) in operations", ["op"], registry=r)
        self.deduplicated = Counter("ferrule_serve_deduplicated", "retried requests answered with the first id",
                                    registry=r)
        self.refused = Counter("ferrule_serve_refused", "requests refused on arrival (4xx)", registry=r)

    def observe_http(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_seconds.labels(method, route).observe(seconds)

    def observe_job(self, job: Any, status: str, seconds: float, batch: int = 1) -> None:
        queued = max(0.0, time.monotonic() - job.submitted - seconds)
        self.ops.labels(job.op, status).inc()
        self.op_seconds.labels(job.op).observe(seconds)
        self.queue_seconds.labels(job.op).observe(queued)
        self.tokens.labels(job.op).inc(job.num_tokens)
        self.data.labels(job.op).inc(job.num_data)
        log.info("op=%s client=%s base=%s model=%s seq=%s data=%d tokens=%d queued_s=%.3f run_s=%.3f batch=%d "
                 "status=%s", job.op, job.tenant, getattr(job, "base", None) or "-", job.model_id or "-", "-" if job.seq_id is None else job.seq_id, job.num_data,
                 job.num_tokens, queued, seconds, batch, status)

    def render(self) -> bytes:
        return generate_latest(self.registry)
