"""A library client given a wrong bootstrap says why at once, as the CLI does, instead of
waiting out its request timeout with a hint about CURVE keys."""

import time

import pytest

from kera import Admin, Consumer, Producer
from kera.errors import PeerUnreachable
from kera.cli.local import free_port

REQUEST_TIMEOUT_S = 10.0
# The answer must come from the probe, well inside the request timeout it replaces.
ANSWER_WITHIN_S = REQUEST_TIMEOUT_S / 2




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
    bootstrap = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(PeerUnreachable, match="connection refused") as exc:
        _first_call(kind, bootstrap)
    assert time.monotonic() - started < ANSWER_WITHIN_S
    assert "CURVE" not in exc.value.message


def test_every_unreachable_coordinator_is_named_with_its_reason():
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", "no-such-host.invalid:7000"]
    with pytest.raises(PeerUnreachable) as exc:
        _first_call("admin", ",".join(dead))
    message = exc.value.message
    assert all(address in message for address in dead), message
    assert message.count("connection refused") == 2 and "unknown host" in message
