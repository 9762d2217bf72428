"""Stream-name patterns: the one syntax of a group's `pattern=`, Spark's `subscribePattern` and
the Kafka listener, Kafka's own (a regular expression that must match the whole name, as Java's
`Pattern.matcher(topic).matches()`).

Patterns are evaluated by RE2 (google-re2), which matches in time linear in the name: the
coordinator matches a client's pattern on its one thread, where a backtracking regex such as
`(a+)+$` could hold it for hours. RE2 refuses what it cannot match linearly (backreferences,
look-around), and the refusal names the construct.
"""

from __future__ import annotations

import re2

from kera.errors import BadRequest

# Stream names are at most 255 characters (Kafka's topic bound); a pattern need not be longer.
PATTERN_CHARS_MAX = 255

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False   # the refusal is raised to the caller, not printed to stderr


class NamePattern:
    """A compiled pattern: `matches(name)` is true when the whole name matches."""

    def __init__(self, text: str):
        if not isinstance(text, str) or not 0 < len(text) <= PATTERN_CHARS_MAX:
            raise BadRequest(f"a stream pattern is a regular expression of 1 to "
                             f"{PATTERN_CHARS_MAX} characters, not {text!r}")
        try:
            self._regex = re2.compile(text, _OPTIONS)
        except re2.error as bad:
            reason = bad.args[0].decode() if bad.args and isinstance(bad.args[0], bytes) \
                else str(bad)
            raise BadRequest(f"stream pattern {text!r} is not a regular expression kera can "
                             f"match in linear time ({reason}); patterns are Kafka's regular "
                             f"expressions, e.g. 'logs-.*', without backreferences or "
                             f"look-around") from None
        self.text = text

    def matches(self, name: str) -> bool:
        return self._regex.fullmatch(name) is not None

    def select(self, names) -> list[str]:
        """The names that match, in the order given."""
        return [n for n in names if self.matches(n)]

    def __repr__(self) -> str:
        return f"NamePattern({self.text!r})"
