"""A Prometheus endpoint: every step metric as a gauge, checkpoint bytes as a counter.

Scraped by GKE Managed Prometheus through the PodMonitoring that `rlscale cluster render`
writes, or by any Prometheus. Names: `rlscale_` + the metric key with non-alphanumerics as `_`
(`reward/mean` -> `rlscale_reward_mean`).
"""

from __future__ import annotations

import math
import re

from rlscale.errors import UserError


def metric_name(key: str) -> str:
    return "rlscale_" + re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_")


class PrometheusSink:
    def __init__(self, port: int, address: str = "0.0.0.0"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry()  # our own: two runs in one process never clash
        self._gauge_cls = Gauge
        self._gauges: dict[str, object] = {}
        self._step = Gauge("rlscale_step", "GRPO step last completed", registry=self.registry)
        self._ckpt_bytes = Counter("rlscale_ckpt_bytes_written", "checkpoint bytes written",
                                   registry=self.registry)
        try:
            self._server, self._thread = start_http_server(port, addr=address, registry=self.registry)
        except OSError as exc:
            raise UserError(f"logger.prometheus_port {port}: cannot serve metrics ({exc.strerror})") from None

    @property
    def port(self) -> int:
        return self._server.server_port

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._step.set(step)
        for key, value in metrics.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                continue
            name = metric_name(key)
            if name not in self._gauges:
                self._gauges[name] = self._gauge_cls(name, f"rlscale metric {key}", registry=self.registry)
            self._gauges[name].set(value)
        if metrics.get("ckpt/bytes"):
            self._ckpt_bytes.inc(metrics["ckpt/bytes"])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
