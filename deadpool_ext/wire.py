"""The control plane's wire: signed JSON messages in the coordinator's
store (what they say is typed in ``protocol``).

The coordinator hosts a ``TCPStore``; agents and workers connect to it. It
carries the process-group rendezvous of each generation (under
``gen{N}/``) and the control messages below. Every control message is JSON
with an HMAC-SHA256 over its topic, sequence number and body, keyed by the
per-job secret. Anything that fails the check is dropped and counted, so a
process without the secret cannot register as a spare, report a failure or
take a rank; and since messages are JSON, nothing from the network is ever
unpickled.

Two shapes:
  * topics: append-only logs (``post`` / ``Reader.poll``), e.g. reports to
    the coordinator or commands to an agent;
  * keys: one signed value that is overwritten (``put`` / ``get``), e.g.
    heartbeats, the current generation and each generation's decision.
"""

import contextlib
import datetime
import hashlib
import hmac
import json
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, NoReturn, Optional, Set, Tuple

import torch.distributed as dist

from deadpool_ext.sockets import connected_to, give_up_on_silence, socket_descriptors
from deadpool_ext.defaults import (
    CLAIMED_SLOT_DEADLINE_S,
    CONTROL_SILENCE_S,
    STORE_MEND_TIMEOUT_S,
    STORE_RECONNECT_TIMEOUT_S,
)
from deadpool_ext.protocol import ENDED_KEY, GEN_KEY, SECRET_ENV, STANDBY_TOPIC, Message


class ControlError(RuntimeError):
    """A control message could not be read or trusted."""


class PortTaken(ControlError):
    """A store's server cannot listen where it was told to (a usage error:
    another port, or another address, is the fix)."""


class JobEnded(Exception):
    """The primary coordinator went away after the job ended: the standby
    has nothing to take over."""


def new_secret() -> str:
    return secrets.token_hex(32)


def job_secret(environ=os.environ) -> bytes:
    """The launcher's secret, else one derived from the Slurm job (every
    node of the job can derive it, nobody outside the job's user can
    read the key file it mixes in)."""
    if environ.get(SECRET_ENV):
        return environ[SECRET_ENV].encode()
    raise ControlError(
        f"no {SECRET_ENV} in the environment: start workers with "
        "deadpool-launch (python -m deadpool_ext.launch)"
    )


def connect(
    host: str,
    port: int,
    timeout_s: float = 60.0,
    is_master: bool = False,
    silent_after_s: Optional[float] = None,
    cut_off_s: Optional[float] = None,
):
    """A client of the store at host:port, waiting up to ``timeout_s`` for
    its server. With ``silent_after_s``, a request its server leaves
    unanswered that long fails the connection, and so does a host that
    acknowledges nothing, data or keepalive probe, for ``cut_off_s`` (default
    ``silent_after_s``: a dead or cut-off host sends no reset, and torch's
    client would wait on it for good); the connection is the control plane's (``control_sockets``).
    With ``is_master``, the
    server too, listening on ``host`` alone (torch's TCPStore would listen
    on every interface: loopback for --standalone keeps the job's store off
    the network)."""
    with _CONNECTING:  # so that the sockets new since ``before`` are this call's
        if silent_after_s is None:
            return _store(host, port, timeout_s, is_master)
        before = set(socket_descriptors())
        with _CONTROL.connecting(before):
            store = _store(host, port, timeout_s, is_master)
            store.set_timeout(datetime.timedelta(seconds=silent_after_s))
            mine = connected_to(port, set(socket_descriptors()) - before)
            for fd in mine.values():
                give_up_on_silence(fd, silent_after_s if cut_off_s is None else cut_off_s)
            _CONTROL.add(mine)
    return store


def _store(host: str, port: int, timeout_s: float, is_master: bool):
    listener = listen(host, port) if is_master else None
    store = dist.TCPStore(
        host,
        port,
        is_master=is_master,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        use_libuv=True,
        master_listen_fd=None if listener is None else listener.fileno(),
    )
    if listener is not None:
        _LISTENERS.append(listener)  # the server's socket lives as long as the process
    return store


class _ControlSockets:
    """This process's control-plane connections, as a generation's release
    must see them: its known ones, and while a control connect is under way
    (a worker's heartbeat thread reaching the standby while its main thread
    tears its groups down), every socket opened since that connect began,
    which it can tell apart only once it ends."""

    def __init__(self):
        self.lock = threading.Lock()
        self.known: Set[int] = set()
        self.connect_since: Optional[Set[int]] = None  # inodes open when it began

    @contextlib.contextmanager
    def connecting(self, before: Set[int]):
        with self.lock:
            self.connect_since = before
        try:
            yield
        finally:
            with self.lock:
                self.connect_since = None

    def add(self, inodes: Iterable[int]) -> None:
        with self.lock:
            self.known.update(inodes)

    def among(self, open_now: Iterable[int]) -> Tuple[Set[int], Set[int]]:
        """(known, pending) among ``open_now``: the control plane's, and those
        a control connect under way may have opened (its own or not)."""
        open_now = set(open_now)
        with self.lock:
            self.known &= open_now  # closed ones are forgotten
            since = self.connect_since
            pending = set() if since is None else open_now - since - self.known
            return set(self.known), pending


# Our own connects, one at a time (a worker's heartbeat thread may connect
# to a standby while its main thread connects for a rendezvous).
_CONNECTING = threading.Lock()
_CONTROL = _ControlSockets()


def control_sockets(open_now: Iterable[int]) -> Tuple[Set[int], Set[int]]:
    """Inodes among ``open_now`` (the inodes open now) that a generation's
    release must leave alone (``rank/generation.py``): the control plane's
    connections, and those a control connect under way may have opened
    (pending: the release looks at them again next time)."""
    return _CONTROL.among(open_now)


def control_connect(
    host: str, port: int, timeout_s: float = 60.0, cut_off_s: float = CONTROL_SILENCE_S
):
    """A control-plane client: its requests never wait for a key, so one
    unanswered for CONTROL_SILENCE_S means the store is gone, and data its
    host leaves unacknowledged for ``cut_off_s`` (defaults.control_cut_off_s)
    that this host is cut off from it."""
    return connect(host, port, timeout_s, silent_after_s=CONTROL_SILENCE_S, cut_off_s=cut_off_s)


_LISTENERS: List[socket.socket] = []


def listening(host: str, port: int) -> bool:
    """Whether a server accepts connections at host:port (a dead store's
    port refuses at once, where connecting again would retry for seconds)."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return False
    return True


def listen(host: str, port: int) -> socket.socket:
    family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as error:
        listener.close()
        raise PortTaken(f"cannot listen on {host}:{port} ({error})") from None
    listener.listen(socket.SOMAXCONN)
    return listener


@dataclass
class _Mark:
    """The newest authentic value a reader has seen of a key."""

    sender: str
    seq: int
    body: dict
    retired: Set[str] = field(default_factory=set)  # the key's earlier senders


class Channel:
    def __init__(
        self,
        store,
        secret: bytes,
        address: Optional[Tuple[str, int]] = None,
        cut_off_s: float = CONTROL_SILENCE_S,
    ):
        """``address``: the store's, to connect again when its server drops
        this client (it does when an outsider overwrote a counter this
        client adds to) or the line to it was cut and healed; ``cut_off_s``:
        the connections' (``control_connect``)."""
        self.store, self.secret, self.address = store, secret, address
        self.cut_off_s = cut_off_s
        self.rejected = 0
        self.replayed = 0
        self.mended = 0  # topic counters an outsider broke, repaired
        # Every value this channel puts carries (sender, seq): the sender is
        # this process's channel, the seq grows per key. A reader takes a
        # key's value only when it is newer than the newest it has seen.
        self.sender = secrets.token_hex(8)
        self._put_seq: Dict[str, int] = {}
        self._marks: Dict[str, _Mark] = {}

    # ----- signing -----
    def _mac(self, where: str, body: str) -> str:
        return hmac.new(self.secret, f"{where}\n{body}".encode(), hashlib.sha256).hexdigest()

    def _seal(self, where: str, body: dict) -> bytes:
        text = json.dumps(body, sort_keys=True)
        return json.dumps({"body": text, "mac": self._mac(where, text)}).encode()

    def _open(self, where: str, raw: bytes) -> Optional[dict]:
        try:
            outer = json.loads(raw.decode())
            text, mac = outer["body"], outer["mac"]
            if hmac.compare_digest(mac, self._mac(where, text)):
                body = json.loads(text)
                if isinstance(body, dict):
                    return body
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            pass
        self.rejected += 1
        return None

    # ----- keys -----
    def put(self, key: str, **body) -> None:
        seq = self._put_seq[key] = self._put_seq.get(key, 0) + 1
        sealed = {"value": body, "sender": self.sender, "seq": seq}
        self.store.set(f"key/{key}", self._seal(f"key/{key}", sealed))

    def get(self, key: str) -> Optional[dict]:
        """The key's newest authentic value: None before one was put; a
        value older than one seen already (a replay) or not authentic is
        not taken, and the newest seen stays the answer."""
        mark = self._read(key)
        return None if mark is None else mark.body

    def version(self, key: str) -> Optional[Tuple[str, int]]:
        """(sender, seq) of the value ``get`` gives: it changes only when an
        authentic newer value is put (a heartbeat's beat)."""
        mark = self._read(key)
        return None if mark is None else (mark.sender, mark.seq)

    def _read(self, key: str) -> Optional[_Mark]:
        name, mark = f"key/{key}", self._marks.get(key)
        sealed = self._open(name, self.store.get(name)) if self.store.check([name]) else None
        try:
            sender, seq, body = sealed["sender"], int(sealed["seq"]), sealed["value"]
        except (TypeError, KeyError, ValueError):
            return mark  # absent, or rejected (counted by _open)
        if mark is None or (sender == mark.sender and seq >= mark.seq):
            new = _Mark(sender, seq, body, mark.retired if mark else set())
        elif sender != mark.sender and sender not in mark.retired:
            new = _Mark(sender, seq, body, mark.retired | {mark.sender})  # a new writer
        else:
            self.replayed += 1
            return mark
        self._marks[key] = new
        return new

    def forget(self, key: str) -> None:
        """Take the key's next value whoever wrote it (a repaired node's
        processes write their old keys again)."""
        self._marks.pop(key, None)

    # ----- topics -----
    def post(self, topic: str, message: Optional[Message] = None, **body) -> None:
        """Append a message (a protocol ``Message``, or a body's fields) to a topic."""
        if message is not None:
            body = message.body()
        seq = self.count(topic, 1)
        name = f"topic/{topic}/{seq}"
        self.store.set(name, self._seal(name, body))

    def count(self, topic: str, claim: int) -> int:
        """Claim ``claim`` slots of a topic (0: read its count). Whoever can
        reach the store can overwrite a counter with a non-number; the
        server then drops each client that adds to it: connect again, set
        the counter to the topic's highest written slot, and count again."""
        key = f"topic/{topic}/n"
        try:
            return self.store.add(key, claim)
        except dist.DistError:
            if self.address is None or not listening(*self.address):
                raise  # no server there any more: the store is gone, not poisoned
        self.store = self.connect_again(STORE_MEND_TIMEOUT_S)
        self.store.set(key, str(self.highest_written(topic)))
        self.mended += 1
        return self.store.add(key, claim)

    def carry_on_from(self, earlier: "Channel") -> None:
        """Take on what ``earlier`` (to the same store) has seen, so that a
        value replayed over a newer one is refused across the two."""
        self._marks = {key: mark for key, mark in earlier._marks.items()}

    def connect_again(self, timeout_s: float):
        return control_connect(*self.address, timeout_s=timeout_s, cut_off_s=self.cut_off_s)

    def answers_again(self) -> bool:
        """Whether the store whose line failed answers again (the line was
        cut, and is healed): then the channel reads and writes through a new
        connection, keeping its readers' places and what it has seen."""
        if self.address is None or not listening(*self.address):
            return False
        try:
            # Short: a dying server found listening, or a host cut off again
            # since, would hold a longer connect for seconds (torch's client
            # tries twice), while the standby may have taken over.
            store = self.connect_again(STORE_MEND_TIMEOUT_S)
            store.check([f"key/{GEN_KEY}"])
        except dist.DistError:
            return False
        self.store = store
        return True

    def highest_written(self, topic: str, gap: int = 64) -> int:
        """The last slot of a topic holding a value (slots claimed and never
        written, fewer than ``gap`` in a row, are passed over)."""
        last, probe = 0, 1
        while probe - last <= gap:
            if self.store.check([f"topic/{topic}/{probe}"]):
                last = probe
            probe += 1
        return last

    def reader(self, topic: str) -> "Reader":
        return Reader(self, topic)


class Reader:
    """Reads a topic in order. A slot claimed but not yet written is waited
    for on the next polls, up to CLAIMED_SLOT_DEADLINE_S: a poster writes
    right after it claims, so one that never does died in between, or was
    no poster (an outsider's claim), and the slot is passed over."""

    def __init__(self, channel: Channel, topic: str, clock=time.monotonic):
        self.channel, self.topic, self.cursor = channel, topic, 0
        self.clock = clock
        self.waiting_since: Optional[float] = None  # for the slot after the cursor
        self.skipped = 0

    def poll(self) -> List[dict]:
        out = []
        count = self.claimed()
        while self.cursor < count:
            store, name = self.channel.store, f"topic/{self.topic}/{self.cursor + 1}"
            if not store.check([name]) and not self.give_up_on(name):
                break
            self.cursor, self.waiting_since = self.cursor + 1, None
            body = self.channel._open(name, store.get(name)) if store.check([name]) else None
            if body is not None:
                out.append(body)
        return out

    def claimed(self) -> int:
        """How many slots of the topic were claimed so far."""
        return self.channel.count(self.topic, 0)

    def give_up_on(self, name: str) -> bool:
        now = self.clock()
        if self.waiting_since is None:
            self.waiting_since = now
        if now - self.waiting_since < CLAIMED_SLOT_DEADLINE_S:
            return False
        self.skipped += 1
        return True

    def skip_history(self) -> None:
        """Read only what is posted from now on."""
        self.cursor = self.claimed()


def standby_channel(
    address: Tuple[str, int],
    secret: bytes,
    timeout_s: float,
    vote: Optional[Message] = None,
    cut_off_s: float = CONTROL_SILENCE_S,
) -> Optional[Channel]:
    """A channel to the standby coordinator's store once it has taken over
    (its coordinator published the generation there), or None if it has not
    within ``timeout_s`` or cannot be reached; ``JobEnded`` if the job had
    ended. ``vote``: an agent's ``LostPrimary``, which the standby counts
    before it takes over."""
    deadline = time.monotonic() + timeout_s
    try:
        channel = voted(address, secret, vote, cut_off_s)
        while not has_taken_over(channel):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
    except dist.DistError:
        return None
    return channel


def voted(address: Tuple[str, int], secret: bytes, vote: Optional[Message], cut_off_s: float):
    """A channel to the standby's store, ``vote`` posted there."""
    store = control_connect(*address, timeout_s=STORE_RECONNECT_TIMEOUT_S, cut_off_s=cut_off_s)
    channel = Channel(store, secret, address=address, cut_off_s=cut_off_s)
    if vote is not None:
        channel.post(STANDBY_TOPIC, vote)
    return channel


def has_taken_over(standby: Channel) -> bool:
    """Whether the standby's coordinator published a generation; JobEnded
    if the job had ended."""
    if standby.get(GEN_KEY) is not None:
        return True
    ended = standby.get(ENDED_KEY)
    if ended is not None:
        raise JobEnded(ended.get("why", "the job ended"))
    return False


def next_coordinator(
    lost: Channel,
    standby: Optional[Tuple[str, int]],
    wait_s: float,
    vote: Optional[Message] = None,
) -> Optional[Channel]:
    """After ``lost``'s store stopped answering: a channel to the standby's
    store once its coordinator took over, or ``lost`` itself once its store
    answers again (the line was cut and is healed: a flap, or this host's
    own partition, which the standby cannot be reached across either);
    None if neither within ``wait_s``; ``JobEnded`` if the job had ended.
    ``vote``: as ``standby_channel``'s, cast once the primary did not
    answer (its host accepts no connection, and still did not when the
    standby's did; or its server did not answer) and the standby's host
    accepts a connection. A process that voted never goes back: the standby
    may take over on its vote, and a primary that heard the voters again
    would then decide beside it."""
    deadline = time.monotonic() + wait_s
    other: Optional[Channel] = None
    cast = False
    while time.monotonic() <= deadline:
        try:
            if other is not None and has_taken_over(other):
                return other
            reachable = not cast and listening(*lost.address)
            if reachable and lost.answers_again():
                return lost
            if other is None and standby is not None and listening(*standby):
                if vote is not None and not cast and not reachable and listening(*lost.address):
                    continue  # its host came back a moment ago: ask it again
                cast = cast or vote is not None
                other = voted(standby, lost.secret, vote, lost.cut_off_s)
                continue  # and ask the standby at once
        except dist.DistError:
            other = None  # reached and lost again: try it anew
        time.sleep(0.05)
    return None


def leave(code: int) -> NoReturn:
    """Exit without destroying the store client: when the store's server
    (node 0's launcher) is already gone, its thread aborts the interpreter's
    exit ("terminate called without an active exception"). For ``main``s only."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
