"""Prometheus metrics (`--metrics-port`, off by default).

Gauges are refreshed from the daemon's status once a second on the trio thread (the index
is not thread-safe, the HTTP server runs on its own thread); the fsync latency histogram is
observed directly where fsyncs complete.
"""

from __future__ import annotations

import logging
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)


class Metrics:
    def __init__(self, port: int, addr: str = "127.0.0.1"):
        r = self.registry = CollectorRegistry()
        self.bytes_written = Gauge("ckptfs_bytes_written", "Data bytes written through the "
                                   "mount", registry=r)
        self.bytes_uploaded = Gauge("ckptfs_bytes_uploaded", "Bytes published to the shared "
                                    "store", registry=r)
        self.bytes_pending = Gauge("ckptfs_bytes_pending_upload", "Bytes waiting to drain",
                                   registry=r)
        self.drain_rate = Gauge("ckptfs_drain_rate_bytes_per_second", "Upload rate (10 s)",
                                registry=r)
        self.segments = Gauge("ckptfs_segments", "Log segments by state", ["state"], registry=r)
        self.shared_ops = Gauge("ckptfs_shared_store_operations", "Operations issued to the "
                                "shared store", ["op"], registry=r)
        self.local_used = Gauge("ckptfs_local_bytes_used", "Segment bytes on NVMe", registry=r)
        self.local_free = Gauge("ckptfs_local_bytes_free", "Free bytes on NVMe", registry=r)
        self.errors = Gauge("ckptfs_drain_error", "1 while the drain is failing", registry=r)
        self.failing = Gauge("ckptfs_drain_failing_seconds", "Seconds since the drain's first "
                             "error after its last success (0 when healthy)", registry=r)
        self.stalled = Gauge("ckptfs_shared_stalled_seconds", "Seconds the shared store has "
                             "not answered while calls into it wait (0 when none waits): a "
                             "hung NAS fails nothing", registry=r)
        self.evictions = Gauge("ckptfs_evictions", "Segments evicted from NVMe", registry=r)
        self.seals = Gauge("ckptfs_seals", "Segment seals by trigger", ["reason"], registry=r)
        self.retries = Counter("ckptfs_status_scrapes", "Metric refreshes", registry=r)
        self.fsync_latency = Histogram(
            "ckptfs_fsync_seconds", "fsync latency seen by applications",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r)
        self.server, self.thread = start_http_server(port, addr=addr, registry=r)
        log.info("metrics on http://%s:%d/metrics", addr, port)

    def update(self, st: dict[str, Any]) -> None:
        self.bytes_written.set(st["bytes_written"])
        self.bytes_uploaded.set(st["bytes_uploaded"])
        self.bytes_pending.set(max(0, st["bytes_pending_upload"]))
        self.drain_rate.set(st["upload_rate_bytes_s"])
        for state in ("active", "sealed", "uploading", "published", "evicted", "dropped",
                      "cold"):
            self.segments.labels(state).set(st["segments"].get(state, 0))
        for op, n in st["shared_ops"].items():
            self.shared_ops.labels(op).set(n)
        self.local_used.set(st["local_bytes_used"])
        self.local_free.set(st["local_bytes_free"])
        self.errors.set(1 if st["last_error"] else 0)
        self.failing.set(st["failing_for_s"])
        self.stalled.set(st["shared_stalled_s"])
        self.evictions.set(st["cache"]["evictions"])
        for reason, n in st["seals"].items():
            self.seals.labels(reason).set(n)
        self.retries.inc()

    async def run(self, status: Any) -> None:
        while True:
            try:
                self.update(status())
            except Exception:
                log.exception("metrics refresh failed")
            await trio.sleep(1.0)

    def close(self) -> None:
        self.server.shutdown()
