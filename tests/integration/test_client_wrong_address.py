"""A library client given a wrong bootstrap says why at once, as the CLI does, instead of
waiting out its request timeout with a hint about CURVE keys."""

import socket
import time
from contextlib import ExitStack, contextmanager

import pytest

from kera import Admin, Consumer, Producer
from kera.errors import PeerUnreachable

REQUEST_TIMEOUT_S = 10.0
# The answer must come from the probe, well inside the request timeout it replaces.
ANSWER_WITHIN_S = REQUEST_TIMEOUT_S / 2


@contextmanager
def refused_address():
    """An address whose connections are refused for as long as the block runs: a socket bound
    to its port and never listening holds the port, so no process can start listening there
    between the pick and the test's connect (a free port picked by a bind-and-close could)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{held.getsockname()[1]}"




def _first_call(kind: str, bootstrap: str) -> None:
    if kind == "producer":
        with Producer(bootstrap, request_timeout_s=REQUEST_TIMEOUT_S) as p:
            p.send("s", b"v").result(timeout=3 * REQUEST_TIMEOUT_S)
    elif kind == "consumer":
        Consumer(bootstrap, "s", request_timeout_s=REQUEST_TIMEOUT_S).close()
    else:
        with Admin(bootstrap, timeout_s=REQUEST_TIMEOUT_S) as a:
            a.list_streams()


@pytest.mark.parametrize("kind", ["producer", "consumer", "admin"])
def test_a_refused_port_is_named_before_the_request_timeout(kind):
    with refused_address() as bootstrap, \
            pytest.raises(PeerUnreachable, match="connection refused") as exc:
        started = time.monotonic()
        _first_call(kind, bootstrap)
    assert time.monotonic() - started < ANSWER_WITHIN_S
    assert "CURVE" not in exc.value.message


def test_every_unreachable_coordinator_is_named_with_its_reason():
    with ExitStack() as held, pytest.raises(PeerUnreachable) as exc:
        dead = [held.enter_context(refused_address()) for _ in range(2)]
        dead.append("no-such-host.invalid:7000")
        _first_call("admin", ",".join(dead))
    message = exc.value.message
    assert all(address in message for address in dead), message
    assert message.count("connection refused") == 2 and "unknown host" in message
