"""Emulated hosts on one machine, and the network's faults between them.

    with Lab(4) as lab:                      # hosts 0-3, as root
        proc = lab.start(0, ["python", "-m", "deadpool_ext.launch", ...])
        lab.isolate(2)                       # silent: every packet dropped
        lab.heal(2)

Each host is a network namespace with one veth into a bridge of the root
namespace, its own address on a private subnet, its own hostname (a UTS
namespace per process started) that every host resolves, as on a cluster.
Processes started in it see only its network: a job's stores, gloo and the
mirror cross a real (virtual) network, where a fault is a rule of the
kernel, not a kill. The faults are ``nft`` rules of the bridge (the switch:
a dropped packet is lost on the way, its sender sees no error) and ``tc``
queueing disciplines on a host's link:

    isolate(h)              every packet to and from h dropped (silent: open
                            connections hang, as behind a dead switch port)
    isolate(h, loud=True)   h's link down (its connects fail at once)
    cut(a, b)               a <-> b dropped, both ways (one_way: a -> b only;
                            port: only TCP to b's port, e.g. the store's)
    flap(h, seconds)        isolated for ``seconds``, then healed
    slow(h, mbit)           h's link at ``mbit`` Mbit/s each way (tbf)
    lose(h, percent)        a random ``percent`` of h's packets dropped
    heal(h)                 every fault of h undone

The kernel here has no netem (no delay or jitter). ``close`` (and leaving
the ``with``) kills whatever runs in the hosts, then removes the
namespaces, the bridge and the hosts files, also after a failure; every
name carries the lab's own prefix, so two labs never meet. Linux, root,
``ip``, ``nft`` and ``tc`` (iproute2, nftables).
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

from deadpool_ext.control.jobs import alive

SUBNET = "10.231.0"  # private; only on the namespaces a lab made


class LabError(RuntimeError):
    """The machine cannot make hosts (not root, no ip or nft): one line why."""


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    address: str
    hostname: str
    link: str  # the veth's end in the root namespace


def missing() -> Optional[str]:
    """Why this machine cannot make hosts, or None."""
    if os.geteuid() != 0:
        return "making hosts (network namespaces) needs root"
    for tool in ("ip", "nft", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"no '{tool}' here (iproute2, nftables, util-linux)"
    return None


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


class Lab:
    def __init__(self, count: int):
        if count > 250:
            raise LabError("at most 250 hosts on one subnet")
        self.prefix = f"dp{os.getpid()}"  # sweep() reads the pid back
        self.bridge = f"{self.prefix}-br"
        self.hosts: List[Host] = [
            Host(
                i,
                f"{self.prefix}-h{i}",
                f"{SUBNET}.{i + 1}",
                f"{self.prefix}-h{i}",
                f"{self.prefix}-v{i}",
            )
            for i in range(count)
        ]
        self.timers: List[threading.Timer] = []
        self.started: List[subprocess.Popen] = []

    def __enter__(self) -> "Lab":
        why = missing()
        if why is not None:
            raise LabError(why)
        sweep()
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_) -> None:
        self.close()

    # ----- the hosts -----
    def build(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "link", "set", self.bridge, "up")
        sh("nft", "add", "table", "bridge", self.prefix)
        chain = "{ type filter hook forward priority 0; policy accept; }"
        sh("nft", "add", "chain", "bridge", self.prefix, "forward", chain)
        for host in self.hosts:
            self.add(host)
        self.write_hosts_files()

    def add(self, host: Host) -> None:
        ns = host.netns
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", host.link, "master", self.bridge, "up")
        sh("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    def write_hosts_files(self) -> None:
        """Every host resolves every hostname (``ip netns exec`` mounts
        /etc/netns/NAME/hosts over /etc/hosts), as on a cluster."""
        names = "".join(f"{h.address} {h.hostname}\n" for h in self.hosts)
        for host in self.hosts:
            folder = f"/etc/netns/{host.netns}"
            os.makedirs(folder, exist_ok=True)
            with open(f"{folder}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{names}")

    def command(self, index: int, argv: Sequence[str]) -> List[str]:
        """``argv`` as a process of host ``index``: its network, its hostname."""
        host = self.hosts[index]
        inner = 'hostname "$0" && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            host.netns,
            "unshare",
            "--uts",
            "sh",
            "-c",
            inner,
            host.hostname,
            *argv,
        ]

    def start(self, index: int, argv: Sequence[str], **popen) -> subprocess.Popen:
        """A process of host ``index`` in a session of its own, so that a
        fault that kills its process group kills nothing outside the host."""
        proc = subprocess.Popen(self.command(index, argv), start_new_session=True, **popen)
        self.started.append(proc)
        return proc

    def close(self) -> None:
        """Kill everything in the hosts; remove them, the bridge and the
        hosts files. Never raises: it runs when a test failed."""
        for timer in self.timers:
            timer.cancel()
        for host in self.hosts:
            kill_all_in(host.netns)
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for host in self.hosts:
            remove_host(host.netns)
            sh("ip", "link", "del", host.link, check=False)
        sh("ip", "link", "del", self.bridge, check=False)
        sh("nft", "delete", "table", "bridge", self.prefix, check=False)

    # ----- faults -----
    def drop(self, match: str, *hosts: int) -> None:
        """A rule of the switch; its comment names the hosts it concerns, so
        that healing any of them removes it."""
        names = " ".join(f"h{i}" for i in hosts)
        rule = ["add", "rule", "bridge", self.prefix, "forward", *match.split()]
        sh("nft", *rule, "drop", "comment", f'"{names} "')

    def port(self, index: int) -> str:
        return f'"{self.hosts[index].link}"'

    def isolate(self, index: int, loud: bool = False) -> None:
        if loud:
            sh("ip", "-n", self.hosts[index].netns, "link", "set", "eth0", "down")
            return
        self.drop(f"iifname {self.port(index)}", index)
        self.drop(f"oifname {self.port(index)}", index)

    def cut(self, a: int, b: int, one_way: bool = False, port: Optional[int] = None) -> None:
        """Packets a -> b dropped (and b -> a unless ``one_way``); with
        ``port``, only TCP to b's ``port`` (and, both ways, its answers)."""
        to_b = f"iifname {self.port(a)} oifname {self.port(b)}"
        to_a = f"iifname {self.port(b)} oifname {self.port(a)}"
        if port is None:
            self.drop(to_b, a, b)
            if not one_way:
                self.drop(to_a, a, b)
            return
        self.drop(f"{to_b} tcp dport {port}", a, b)
        if not one_way:
            self.drop(f"{to_a} tcp sport {port}", a, b)

    def cut_data(self, index: int, keep_ports: Sequence[int]) -> None:
        """Every TCP connection between host ``index`` and the others dropped
        but those to or from ``keep_ports`` (the control plane's stores):
        the node's heartbeats arrive, its peers cannot reach it."""
        # A set of two or more: nft merges two adjacent one-value "!="
        # matches of the TCP header into one of both ports at once, which
        # drops a packet that differs in either (port 0 is never a peer's).
        keep = "{ " + ", ".join(str(p) for p in {0, *keep_ports}) + " }"
        for other in range(len(self.hosts)):
            for a, b in ((index, other), (other, index)) if other != index else ():
                between = f"iifname {self.port(a)} oifname {self.port(b)}"
                self.drop(f"{between} tcp dport != {keep} tcp sport != {keep}", index, other)

    def lose(self, index: int, percent: int) -> None:
        if not 0 < percent <= 100:
            raise LabError(f"lose {percent}%: a share of packets from 1 to 100")
        chance = "" if percent == 100 else f" numgen random mod 100 < {percent}"
        for side in ("iifname", "oifname"):
            self.drop(f"{side} {self.port(index)}{chance}", index)

    def slow(self, index: int, mbit: float) -> None:
        """Both ways: the host's egress, and the bridge's egress toward it."""
        host = self.hosts[index]
        shape = ["tbf", "rate", f"{mbit}mbit", "burst", "32kbit", "latency", "400ms"]
        in_host(host, "tc", "qdisc", "replace", "dev", "eth0", "root", *shape)
        sh("tc", "qdisc", "replace", "dev", host.link, "root", *shape)

    def flap(self, index: int, seconds: float) -> threading.Timer:
        self.isolate(index)
        timer = threading.Timer(seconds, self.heal, (index,))
        timer.daemon = True
        self.timers.append(timer)
        timer.start()
        return timer

    def heal(self, index: int) -> None:
        """Every fault of host ``index`` undone, and the cuts toward it."""
        host = self.hosts[index]
        listing = sh("nft", "-a", "list", "chain", "bridge", self.prefix, "forward").stdout
        for line in listing.splitlines():
            if f"h{index} " in line.split("comment", 1)[-1] and "# handle" in line:
                handle = line.rsplit("# handle", 1)[1].strip()
                sh("nft", "delete", "rule", "bridge", self.prefix, "forward", "handle", handle)
        sh("ip", "-n", host.netns, "link", "set", "eth0", "up")
        in_host(host, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        sh("tc", "qdisc", "del", "dev", host.link, "root", check=False)


def sweep() -> None:
    """Remove what labs whose process died without closing (a SIGKILL)
    left: their namespaces, links and hosts files (named dp<pid>-...)."""
    listed = sh("ip", "netns", "list", check=False).stdout.split()
    links = sh("ip", "-o", "link", "show", check=False).stdout
    names = [n for n in listed if re.fullmatch(r"dp\d+-h\d+", n)]
    names += [m for m in re.findall(r"^\d+: (dp\d+-(?:br|v\d+))[@:]", links, re.M)]
    tables = sh("nft", "list", "tables", "bridge", check=False).stdout
    for table in re.findall(r"^table bridge (dp\d+)$", tables, re.M):
        if not alive(int(table[2:])):
            sh("nft", "delete", "table", "bridge", table, check=False)
    for name in names:
        pid = int(name[2:].split("-")[0])
        if alive(pid) or not name.startswith(f"dp{pid}-"):
            continue
        if "-h" in name:
            kill_all_in(name)
            remove_host(name)
        else:
            sh("ip", "link", "del", name, check=False)


def kill_all_in(netns: str) -> None:
    """SIGKILL every process of a host (its namespace's)."""
    for pid in sh("ip", "netns", "pids", netns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remove_host(netns: str) -> None:
    """A host's namespace (its end of the veth goes with it) and hosts file."""
    sh("ip", "netns", "del", netns, check=False)
    shutil.rmtree(f"/etc/netns/{netns}", ignore_errors=True)


def in_host(host: Host, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh("ip", "netns", "exec", host.netns, *argv, check=check)


def wait_until(predicate, timeout_s: float, every_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return predicate()
