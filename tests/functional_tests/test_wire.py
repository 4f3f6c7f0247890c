"""The control plane when a store's host goes silent (dies without a reset):
a control-plane client gives up once its bound has passed, where torch's
client (the control) waits for good. The host runs in a network namespace
of the test's own, the store and the client in processes of their own.
(The control plane's admission and messages, in-process, are in
tests/unit_tests/test_wire.py.)"""

import os
import signal
import time

import pytest

pytestmark = pytest.mark.integration

# A test host in a network namespace of this test's own (root, iproute2):
# taking its link down is a host that died without a word, no reset sent.
SILENT_NS, SILENT_HOST, SILENT_PORT = "deadpool-silent", "10.231.7.2", 29411
SERVE = (
    "import sys, time\n"
    "from deadpool_ext.wire import connect\n"
    f"server = connect('{SILENT_HOST}', {SILENT_PORT}, is_master=True)\n"
    "time.sleep(300)\n"
)
# A client's request once the host is silent: the elapsed seconds, or an
# error's name with them.
ASK = (
    "import sys, time\n"
    "from deadpool_ext.wire import connect\n"
    "bounds = [float(a) for a in sys.argv[1:]] + [None, None]\n"
    f"store = connect('{SILENT_HOST}', {SILENT_PORT}, timeout_s=20,\n"
    "                silent_after_s=bounds[0], cut_off_s=bounds[1])\n"
    "store.set('a', b'1')\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()  # the host goes silent\n"
    "start = time.monotonic()\n"
    "try:\n"
    "    store.get('a')\n"
    "    print('answered', flush=True)\n"
    "except Exception as error:\n"
    "    print(type(error).__name__, round(time.monotonic() - start, 1), flush=True)\n"
)


@pytest.fixture()
def test_host():
    """A host at SILENT_HOST, in a namespace of its own, linked to this one."""
    import subprocess

    def ip(*args, ns=None):
        prefix = ["ip", "netns", "exec", ns] if ns else []
        subprocess.run([*prefix, "ip", *args], check=True, capture_output=True)

    subprocess.run(["ip", "netns", "del", SILENT_NS], capture_output=True)  # a killed run's
    subprocess.run(["ip", "link", "del", "dpsil0"], capture_output=True)
    try:
        ip("netns", "add", SILENT_NS)
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"no network namespaces here (needs root and iproute2): {error}")
    try:
        ip("link", "add", "dpsil0", "type", "veth", "peer", "name", "dpsil1")
        ip("link", "set", "dpsil1", "netns", SILENT_NS)
        ip("addr", "add", "10.231.7.1/24", "dev", "dpsil0")
        ip("link", "set", "dpsil0", "up")
        ip("addr", "add", f"{SILENT_HOST}/24", "dev", "dpsil1", ns=SILENT_NS)
        ip("link", "set", "dpsil1", "up", ns=SILENT_NS)
        yield lambda server: ip("link", "set", "dpsil1", "down", ns=SILENT_NS)
    finally:
        subprocess.run(["ip", "netns", "del", SILENT_NS], capture_output=True)
        subprocess.run(["ip", "link", "del", "dpsil0"], capture_output=True)


def ask_silent_host(go_silent, *flags, patience_s: float = 10, after_asking=None) -> str:
    """The client's answer (``ASK``) to its request once ``go_silent(server)``
    ran, and ``after_asking(server)`` half a second after the request."""
    import subprocess
    import sys

    from dist_utils import REPO, worker_env

    serve = [sys.executable, "-c", SERVE]
    server = subprocess.Popen(
        ["ip", "netns", "exec", SILENT_NS, *serve], env=worker_env(), cwd=REPO
    )
    client = subprocess.Popen(
        [sys.executable, "-c", ASK, *flags],
        env=worker_env(),
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert client.stdout.readline().strip() == "ready"
        go_silent(server)
        client.stdin.write("\n")
        client.stdin.flush()
        if after_asking is not None:
            time.sleep(0.5)  # the request is sent, and acknowledged by the host
            after_asking(server)
        client.wait(timeout=patience_s)
        return client.stdout.read().strip()
    except subprocess.TimeoutExpired:
        return f"still waiting after {patience_s:g} s"
    finally:
        client.kill()
        server.kill()


def test_a_control_client_gives_up_on_a_store_whose_host_went_silent(test_host):
    """A dead host sends no reset: torch's client waits on it for good (the
    control), so a standby would never hear that the primary is gone. A
    control-plane client fails instead once its request has gone
    unanswered for its bound (wire.connect's silent_after_s)."""
    answer = ask_silent_host(test_host, "2")
    name, seconds = answer.split()[:2] if answer.count(" ") == 1 else (answer, "-1")
    assert name == "DistNetworkError" and 1.5 <= float(seconds) <= 6, answer


def test_a_cut_off_host_is_known_by_its_unacknowledged_data(test_host):
    """With a standby a control line is cut off after the heartbeat timeout
    (``cut_off_s``), well before a silent server's bound: the host's kernel
    acknowledges nothing."""
    name, seconds = ask_silent_host(test_host, "30", "2").split()
    assert name == "DistNetworkError" and 1.5 <= float(seconds) <= 6


def pause(server):
    os.kill(server.pid, signal.SIGSTOP)


def test_a_paused_server_is_not_taken_for_a_cut_off_host(test_host):
    """Its host's kernel acknowledges the request, so the cut-off never
    ends the wait: the client waits for the server to wake (the control is
    the test above: a silent host, cut off after 2 s)."""
    assert ask_silent_host(pause, "30", "1", patience_s=5) == "still waiting after 5 s"


def test_a_host_cut_off_while_it_owes_an_answer_is_known_too(test_host):
    """The request reached the host and was acknowledged, and the host was
    cut off before it answered: the client has no data unacknowledged, yet
    the line is known to be cut after about the cut-off (the kernel probes
    an idle control line), not after the 30 s bound (which torch's client
    does not keep while it waits for an answer). The control: the same
    paused server, not cut off, is still waited for (the test above)."""
    answer = ask_silent_host(pause, "30", "1", patience_s=10, after_asking=test_host)
    name, seconds = answer.split()[:2] if answer.count(" ") == 1 else (answer, "-1")
    assert name == "DistNetworkError" and 0.5 <= float(seconds) <= 6, answer


def test_without_the_bound_a_client_waits_on_a_silent_host(test_host):
    assert ask_silent_host(test_host) == "still waiting after 10 s"
