"""Requests to a running job: deadpool-ctl's status, drain and stop, and an
agent's drain when Slurm marked its node DRAIN. Each arrives signed on the
requests' topic; the answer goes to the key it names (``answer``).

What a request may do is the policy's (policy/requests.py); what it
changes comes back as effects for the coordinator to carry out (a drain
queued, a stop asked for), beside the answer.
"""

from typing import Callable, Optional, Tuple

from deadpool_ext import protocol as P
from deadpool_ext.policy import requests
from deadpool_ext.policy.effects import NOTHING, Effects, QueueDrain, StopAsked
from deadpool_ext.policy.view import JobView
from deadpool_ext.wire import Channel, control_connect


def requests_reader(channel: Channel):
    """The requests' topic, on a connection of its own: anyone who reaches
    the store can break the topic's counter, and the server then drops the
    connection that adds to it (the channel mends its own; a shared one
    would leave the coordinator's broken)."""
    store = channel.store if channel.address is None else control_connect(*channel.address)
    return Channel(store, channel.secret, address=channel.address).reader(P.CONTROL_TOPIC)


class Refused(ValueError):
    """A signed request of the wrong shape (another version, or a bug)."""


def parse(body: dict) -> P.ControlRequest:
    try:
        m = P.parse_message(body)
        if not isinstance(m, P.ControlRequest):
            raise P.ProtocolError(f"{m.KIND.value} is no request")
        P.Request(m.request)
    except (P.ProtocolError, ValueError) as error:
        raise Refused(str(error)) from None
    return m


def answer(m: P.ControlRequest, view: JobView, status: Callable[[], dict]) -> Tuple[dict, Effects]:
    """The answer to a parsed request, and what it changes."""
    request = P.Request(m.request)
    if request == P.Request.STATUS:
        return {"ok": True, "status": status()}, NOTHING
    if request == P.Request.DRAIN:
        refused = requests.why_no_drain(view, m.node)
        accepted = requests.drain_accepted(m.node)
        effects = (QueueDrain(m.node, m.reason or f"asked by {m.by}", m.by),)
    else:
        refused = requests.why_no_stop(view)
        accepted = requests.stop_accepted(view)
        effects = (StopAsked(m.reason or f"stopped by {m.by}", m.by),)
    return reply(refused, accepted), NOTHING if refused else effects


def reply(refused: Optional[str], accepted: str) -> dict:
    return {"ok": refused is None, "message": refused or accepted}
