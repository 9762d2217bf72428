"""Stream-name patterns (kera.codec.name_pattern): Kafka's syntax, a regular expression that
must match the whole name, matched in linear time."""

import pytest

from kera.codec.name_pattern import PATTERN_CHARS_MAX, NamePattern
from kera.errors import BadRequest


def test_a_pattern_is_a_regular_expression_over_the_whole_name():
    p = NamePattern("logs-.*")
    assert p.select(["logs-a", "logs-", "xlogs-a", "logs", "metrics"]) == ["logs-a", "logs-"]
    # A glob's star is a regex repetition: "logs-*" is "logs" and any number of dashes.
    assert NamePattern("logs-*").select(["logs-a", "logs--"]) == ["logs--"]
    assert NamePattern("a|b").select(["a", "b", "ab"]) == ["a", "b"]


def test_a_backtracking_pattern_is_matched_without_backtracking():
    # Exponential for a backtracking engine on a 40-character miss; linear for RE2.
    assert not NamePattern("(a+)+$").matches("a" * 40 + "!")


@pytest.mark.parametrize("text, reason", [
    ("(a)\\1", "escape"), ("[a-", "missing"), ("", "1 to"), ("x" * (PATTERN_CHARS_MAX + 1), "1 to"),
])
def test_a_pattern_kera_cannot_match_is_refused_with_the_reason(text, reason):
    with pytest.raises(BadRequest, match=reason):
        NamePattern(text)
