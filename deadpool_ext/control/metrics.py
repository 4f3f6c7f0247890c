"""The coordinator's state as Prometheus metrics (``--deadpool-metrics-port``).

The coordinator hands its newest status dict to ``MetricsServer.update`` every
poll; a scrape of ``/metrics`` turns that dict into metric families. Nothing is
computed at scrape time beyond reading the dict, so a slow or frequent scraper
never delays the coordinator, and the metrics are exactly what ``status`` says.
"""

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deadpool_ext.protocol import JobState

# Every state gets its sample (1 for the job's, 0 for the others), so a
# dashboard can plot each one's line.
JOB_STATES = tuple(state.value for state in JobState)

SPARE_STATES = ("ready", "warming")


class MetricsServer:
    """Serves the newest coordinator status on its own HTTP endpoint."""

    def __init__(self):
        self._status = None
        self._server = None
        self._thread = None

    def update(self, status: dict) -> None:
        # One reference assignment is atomic under the GIL: the scrape thread
        # sees either the old dict or the new one, never a half-written one.
        self._status = status

    def latest(self):
        return self._status

    def start(self, port: int, addr: str) -> int:
        """Starts serving on (addr, port); returns the bound port (0 picks a free one)."""
        # A registry of our own, not the global REGISTRY: the global one carries
        # process and platform collectors that are not the job's state, and only
        # one server per process could register the collector there.
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_StatusCollector(self.latest))
        self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        return self._server.server_port

    @property
    def server_address(self):
        return self._server.server_address if self._server else None

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._server = self._thread = None


class _StatusCollector:
    """Builds the metric families from whatever status the server holds now."""

    def __init__(self, latest_status):
        self._latest_status = latest_status

    def collect(self):
        status = self._latest_status()
        # Before the first poll there is no job state to tell: an empty scrape
        # is honest, zeros would read as a job at generation 0.
        if status is None:
            return
        yield from _job_metrics(status)
        yield from _node_metrics(status)
        yield from _recovery_metrics(status)
        yield from _straggler_metrics(status)
        yield from _request_metrics(status)


def _gauge(name, doc, value):
    return GaugeMetricFamily(name, doc, value=value)


def _labelled_gauge(name, doc, label_names, samples):
    family = GaugeMetricFamily(name, doc, labels=label_names)
    for labels, value in samples:
        # Label values must be strings; a coordinator that keys by int still scrapes.
        family.add_metric([str(v) for v in labels], value)
    return family


def _job_metrics(status):
    state = status.get("state")
    yield _labelled_gauge(
        "deadpool_job_state",
        "The coordinator's job state: 1 for the current one.",
        ["state"],
        [([s], 1 if s == state else 0) for s in JOB_STATES],
    )
    yield from _optional_gauge("deadpool_generation", "The current generation.", status)
    yield from _optional_gauge(
        "deadpool_iteration", "The last iteration every rank finished.", status
    )
    yield from _optional_gauge("deadpool_world_size", "Ranks in the current generation.", status)
    yield from _optional_gauge("deadpool_planned_world_size", "Ranks the plan asks for.", status)
    spares = status.get("spares") or {}
    yield _labelled_gauge(
        "deadpool_spares",
        "Spare slots, by readiness.",
        ["state"],
        [([s], len(spares.get(s) or ())) for s in SPARE_STATES],
    )


def _optional_gauge(name, doc, status):
    # The status key is the metric's name without the prefix; a value the
    # coordinator does not know yet (None, e.g. the iteration before the first
    # one ends) is left out rather than exported as a misleading 0.
    value = status.get(name.removeprefix("deadpool_"))
    if value is not None:
        yield _gauge(name, doc, value)


def _node_metrics(status):
    nodes = status.get("nodes") or {}
    yield _labelled_gauge(
        "deadpool_node_role",
        "Each node's role (active, spare, draining, drained, lost): 1 for its role.",
        ["node", "role"],
        [([node, info.get("role", "unknown")], 1) for node, info in nodes.items()],
    )
    yield _labelled_gauge(
        "deadpool_node_compute_seconds",
        "Each node's recent forward-backward compute time per iteration.",
        ["node"],
        [
            ([node], info["compute_s"])
            for node, info in nodes.items()
            if info.get("compute_s") is not None
        ],
    )


def _recovery_metrics(status):
    recoveries = CounterMetricFamily(
        "deadpool_recoveries", "Recoveries since the job started, by cause.", labels=["cause"]
    )
    for cause, count in (status.get("recoveries") or {}).items():
        recoveries.add_metric([str(cause)], count)
    yield recoveries

    last = status.get("last_recovery")
    if last is None:
        return
    if last.get("seconds") is not None:
        yield _gauge(
            "deadpool_last_recovery_seconds", "The last recovery's duration.", last["seconds"]
        )
    yield _labelled_gauge(
        "deadpool_last_recovery_stage_seconds",
        "The last recovery's duration, by stage.",
        ["stage"],
        [([stage], seconds) for stage, seconds in (last.get("stages") or {}).items()],
    )


def _straggler_metrics(status):
    stragglers = status.get("stragglers") or {}
    yield _labelled_gauge(
        "deadpool_straggler",
        "1 for each node the detector calls a straggler.",
        ["node"],
        [([node], 1) for node in stragglers],
    )
    yield _labelled_gauge(
        "deadpool_straggler_ratio",
        "A straggler's compute time over the other nodes'.",
        ["node"],
        [
            ([node], info["ratio"])
            for node, info in stragglers.items()
            if info.get("ratio") is not None
        ],
    )


def _request_metrics(status):
    yield _gauge(
        "deadpool_drains_pending",
        "Drain requests accepted but not yet carried out.",
        len(status.get("drains_pending") or {}),
    )
    rejected = CounterMetricFamily(
        "deadpool_rejected_requests", "Operator requests the coordinator refused."
    )
    rejected.add_metric([], status.get("rejected_requests") or 0)
    yield rejected
