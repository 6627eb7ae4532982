"""``/metrics``: the job's numbers in Prometheus text format (``prometheus_client``).

A custom collector in a registry of its own (nothing process-global is registered): at scrape
time it copies the numbers out of the status board and the coordinator under the lock, then
builds the metric families without it.

    lsgd_iterations                      global iterations counted
    lsgd_iteration_budget                ITERATIONS (absent without one)
    lsgd_rounds_total{kind}              rounds opened: local | global | final
    lsgd_iterations_per_second           over the last ~10 s
    lsgd_nodes_alive, lsgd_nodes_expected
    lsgd_round_latency_seconds           histogram of global and final rounds, opening to closing
    lsgd_param_bytes_total{direction}    parameter data received (in) and sent (out)
    lsgd_bulk_transfers_total{outcome}   the bulk port's connections (absent when it is off)
    lsgd_rpc_errors_total{method,code}   failed gRPC calls by method and status code
    lsgd_job_stopped                     1 once the job is over (finished or stopped)
    lsgd_global_server_restarts          times this job's global server was started again
    lsgd_job_info{job_id,algorithm}      always 1
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.utils import floatToGoString

from .status import LATENCY_BUCKETS

__all__ = ["CONTENT_TYPE_LATEST", "JobCollector", "make_registry", "render"]


class JobCollector:
    """Reads a ``GlobalServicer``'s board, coordinator and call counts at each scrape."""

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer

    def collect(self) -> Iterator[Metric]:
        s = self.servicer
        with s.cond:
            m = s.board.metrics(s.coord, s.clock())
            job_id, algorithm = s.coord.job_id, s.coord.algorithm
        errors, bytes_in, bytes_out = s.stats.copy()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge("lsgd_iterations", "Global iterations counted (SGD steps of all workers).",
                    m["iterations"])
        if m["budget"] is not None:
            yield gauge("lsgd_iteration_budget", "The job's iteration budget (ITERATIONS).",
                        m["budget"])
        rounds = CounterMetricFamily("lsgd_rounds", "Rounds opened, by kind.", labels=["kind"])
        for kind, n in m["rounds"].items():
            rounds.add_metric([kind], n)
        yield rounds
        yield gauge("lsgd_iterations_per_second", "Global iterations per second, last ~10 s.",
                    m["rate"])
        yield gauge("lsgd_nodes_alive", "Nodes taking part now.", m["alive"])
        yield gauge("lsgd_nodes_expected", "Nodes of the job (NUM_GROUPS).", m["expected"])
        buckets, total = [], 0
        for bound, n in zip((*LATENCY_BUCKETS, float("inf")), m["latency"]):
            total += n
            buckets.append((floatToGoString(bound), total))
        yield HistogramMetricFamily(
            "lsgd_round_latency_seconds",
            "Global and final rounds: seconds from opening to closing (every node reported).",
            buckets=buckets, sum_value=m["latency_sum"])
        moved = CounterMetricFamily("lsgd_param_bytes", "Parameter data the global server "
                                    "received (in) and sent (out), on gRPC streams and its bulk "
                                    "port.", labels=["direction"])
        moved.add_metric(["in"], bytes_in)
        moved.add_metric(["out"], bytes_out)
        yield moved
        port = getattr(s, "bulk_server", None)
        if port is not None:
            bulk = CounterMetricFamily("lsgd_bulk_transfers", "Connections to the bulk port "
                                       "(BULK_PORT) by outcome: upload, download (whole), "
                                       "refused (a status said), broken, no_request, "
                                       "turned_away (too many).", labels=["outcome"])
            for outcome, n in port.counts().items():
                bulk.add_metric([outcome], n)
            yield bulk
        failed = CounterMetricFamily("lsgd_rpc_errors", "Failed gRPC calls, by method and "
                                     "status code.", labels=["method", "code"])
        for (method, code), n in sorted(errors.items()):
            failed.add_metric([method, code], n)
        yield failed
        yield gauge("lsgd_job_stopped", "1 once the job is over (finished, or stopped).",
                    1 if m["over"] else 0)
        yield gauge("lsgd_global_server_restarts", "Times this job's global server was started "
                    "again (by node 0's supervisor).", m["restarts"])
        info = GaugeMetricFamily("lsgd_job_info", "The job (always 1).",
                                 labels=["job_id", "algorithm"])
        info.add_metric([job_id, algorithm], 1)
        yield info


def make_registry(servicer: Any) -> CollectorRegistry:
    """A registry holding only the job's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(servicer))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format (``CONTENT_TYPE_LATEST``)."""
    return generate_latest(registry)
