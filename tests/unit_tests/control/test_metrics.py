"""The coordinator's Prometheus endpoint (deadpool_ext/control/metrics.py), over real HTTP."""

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deadpool_ext.control.metrics import JOB_STATES, MetricsServer

STATUS = {
    "state": "training",
    "generation": 3,
    "iteration": 42,
    "world_size": 8,
    "planned_world_size": 8,
    "members": {"0": "0.0", "1": "0.1"},
    "spares": {"ready": ["2.0", "2.1"], "warming": ["3.0"]},
    "nodes": {
        "0": {"role": "active", "compute_s": 0.12, "ranks": [0, 1]},
        "1": {"role": "draining", "compute_s": 0.36, "ranks": [2, 3]},
        "2": {"role": "spare", "compute_s": None, "ranks": []},
    },
    "recoveries": {"failure": 1, "drain": 1},
    "last_recovery": {
        "generation": 2,
        "cause": "drain",
        "action": "recover",
        "reason": "operator",
        "seconds": 3.2,
        "rollback_to": 40,
        "stages": {"report": 0.5, "rebuild": 2.7},
    },
    "stragglers": {"1": {"compute_s": 0.36, "others_s": 0.12, "ratio": 3.0, "since_iteration": 14}},
    "drains_pending": {"1": "reason"},
    "rejected_requests": 2,
}


@pytest.fixture
def servers():
    """Starts MetricsServers on demand and always stops them."""
    started = []

    def start():
        server = MetricsServer()
        port = server.start(0, "127.0.0.1")
        started.append(server)
        return server, port

    yield start
    for server in started:
        server.stop()


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def samples_by_name(text):
    """{sample name: {frozenset of label items: value}} for the deadpool_ samples."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("deadpool_"):
                key = frozenset(sample.labels.items())
                samples.setdefault(sample.name, {})[key] = sample.value
    return samples


def value(samples, name, **labels):
    return samples[name][frozenset(labels.items())]


def test_no_deadpool_metrics_before_the_first_update(servers):
    _, port = servers()
    assert samples_by_name(scrape(port)) == {}


def test_status_becomes_metrics(servers):
    server, port = servers()
    server.update(STATUS)
    samples = samples_by_name(scrape(port))

    states = samples["deadpool_job_state"]
    assert value(samples, "deadpool_job_state", state="training") == 1
    assert sum(states.values()) == 1
    assert {dict(k)["state"] for k in states} == set(JOB_STATES)

    assert value(samples, "deadpool_generation") == 3
    assert value(samples, "deadpool_iteration") == 42
    assert value(samples, "deadpool_world_size") == 8
    assert value(samples, "deadpool_planned_world_size") == 8
    assert value(samples, "deadpool_spares", state="ready") == 2
    assert value(samples, "deadpool_spares", state="warming") == 1

    assert value(samples, "deadpool_node_role", node="1", role="draining") == 1
    assert value(samples, "deadpool_node_compute_seconds", node="0") == 0.12
    # A node without a compute time is left out, not exported as 0.
    assert frozenset({("node", "2")}) not in samples["deadpool_node_compute_seconds"]

    assert value(samples, "deadpool_recoveries_total", cause="failure") == 1
    assert value(samples, "deadpool_recoveries_total", cause="drain") == 1
    assert value(samples, "deadpool_last_recovery_seconds") == 3.2
    assert value(samples, "deadpool_last_recovery_stage_seconds", stage="rebuild") == 2.7

    assert samples["deadpool_straggler"] == {frozenset({("node", "1")}): 1}
    assert value(samples, "deadpool_straggler_ratio", node="1") == 3.0
    assert value(samples, "deadpool_drains_pending") == 1
    assert value(samples, "deadpool_rejected_requests_total") == 2


def test_newest_update_wins(servers):
    server, port = servers()
    server.update(STATUS)
    server.update({**STATUS, "state": "recovering", "iteration": None, "last_recovery": None})
    samples = samples_by_name(scrape(port))
    assert value(samples, "deadpool_job_state", state="recovering") == 1
    assert value(samples, "deadpool_job_state", state="training") == 0
    assert "deadpool_iteration" not in samples
    assert "deadpool_last_recovery_seconds" not in samples


def test_missing_keys_do_not_break_the_scrape(servers):
    server, port = servers()
    server.update({"state": "starting"})
    samples = samples_by_name(scrape(port))
    assert value(samples, "deadpool_job_state", state="starting") == 1
    assert value(samples, "deadpool_spares", state="ready") == 0
    assert value(samples, "deadpool_rejected_requests_total") == 0


def test_binds_only_the_address_asked(servers):
    server, _ = servers()
    assert server.server_address[0] == "127.0.0.1"


def test_two_servers_run_at_once_with_their_own_registries(servers):
    first, first_port = servers()
    second, second_port = servers()
    assert first_port != second_port
    first.update({**STATUS, "generation": 1})
    second.update({**STATUS, "generation": 2})
    assert value(samples_by_name(scrape(first_port)), "deadpool_generation") == 1
    assert value(samples_by_name(scrape(second_port)), "deadpool_generation") == 2


def test_stop_is_safe_twice():
    server = MetricsServer()
    server.start(0, "127.0.0.1")
    server.stop()
    server.stop()
