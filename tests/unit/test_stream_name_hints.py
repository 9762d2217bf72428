"""A "did you mean" hint names only a stream the caller may describe (issue 37): a client key
with a grant on a mistyped name must not learn the name of a stream the ACLs hide from it."""

from __future__ import annotations

import pytest

from kera.coordinator.core import Coordinator
from kera.errors import UnknownStream
from kera.net.keys import Principal

CLIENT = Principal("etl", "client")


def cluster() -> Coordinator:
    c = Coordinator(0.0)
    c.register(0.0, "broker", "127.0.0.1:7000", "n0")
    c.handle("create_stream", {"name": "payroll-secret", "streamlets": 1}, 0.0)
    return c


def grant(c: Coordinator, stream: str) -> None:
    c.handle("acl_add", {"acls": [["etl", "allow", "describe", "stream", stream, "literal"]]}, 0.0)


def test_a_hidden_stream_is_never_suggested():
    c = cluster()
    grant(c, "payroll-secre")
    with pytest.raises(UnknownStream) as err:
        c.handle("describe_stream", {"name": "payroll-secre"}, 0.0, CLIENT)
    assert "payroll-secret" not in err.value.message


def test_a_stream_the_caller_may_describe_is_suggested():
    c = cluster()
    grant(c, "payroll-secret")
    with pytest.raises(UnknownStream, match="did you mean 'payroll-secret'"):
        c.handle("describe_stream", {"name": "payroll-secre"}, 0.0, CLIENT)
    with pytest.raises(UnknownStream, match="did you mean 'payroll-secret'"):
        c.handle("describe_stream", {"name": "payroll-secre"}, 0.0)   # plaintext: all
