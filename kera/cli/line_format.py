"""kcat-style line formats: how `kera consume -f` prints a record and `kera produce -f` reads one.

A format is literal text with fields (`%s` value, `%k` key, `%T` timestamp in ms, `%h` headers
as `k=v,k=v`, and for printing only the record's place: `%t %S %p %g %o %n`), `%%` for a percent
sign and `\\n \\t \\r \\\\` escapes. The same format reads back what it printed, so

    kera consume a --from earliest -f '%T\\t%h\\t%k\\t%s\\n' | kera produce b -f '%T\\t%h\\t%k\\t%s'

copies keys, values, timestamps and headers. Reading splits a line at each literal text between
fields in turn; the last field takes the rest of the line, so only it may contain the text that
separates it from the one before.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from kera.cli.output import CliError

# kcat's -f fields that a kera record has (%p is kcat's partition: kera's streamlet, %S).
PRINT_FIELDS = {
    "s": lambda r: r.value or b"", "k": lambda r: r.key or b"", "t": lambda r: r.stream.encode(),
    "S": lambda r: b"%d" % r.streamlet, "p": lambda r: b"%d" % r.streamlet,
    "g": lambda r: b"%d" % r.group, "o": lambda r: b"%d" % r.offset,
    "n": lambda r: b"" if r.number is None else b"%d" % r.number,
    "T": lambda r: b"%d" % (r.timestamp // 1000),
    "h": lambda r: b",".join(k.encode() + b"=" + v for k, v in r.headers),
}
# What a producer sets; the rest (where a record landed) the cluster decides.
READ_FIELDS = ("s", "k", "T", "h")
ESCAPES = {"n": b"\n", "t": b"\t", "r": b"\r", "\\": b"\\"}


def _tokens(fmt: str, known) -> list[tuple[str, bytes]]:
    """[("field", b"s") | ("text", b"...")], adjacent texts merged; CliError names a bad field."""
    out: list[tuple[str, bytes]] = []
    i = 0
    while i < len(fmt):
        ch, nxt = fmt[i], fmt[i + 1:i + 2]
        if ch == "%" and nxt in known:
            out.append(("field", nxt.encode()))
        elif ch == "%" and nxt != "%":
            raise CliError(f"--format: unknown field %{nxt} (known: "
                           f"{', '.join('%' + k for k in known)}, %%)")
        else:
            text = (b"%" if ch == "%" else ESCAPES[nxt] if ch == "\\" and nxt in ESCAPES
                    else None)
            if text is None:
                text, i = ch.encode(), i - 1
            if out and out[-1][0] == "text":
                text = out.pop()[1] + text
            out.append(("text", text))
        i += 2
    return out


def compile_format(fmt: str) -> Callable:
    """A function record -> bytes for `kera consume -f`."""
    parts = [PRINT_FIELDS[v.decode()] if kind == "field" else (lambda r, b=v: b)
             for kind, v in _tokens(fmt, PRINT_FIELDS)]
    return lambda record: b"".join(part(record) for part in parts)


class ParsedLine(NamedTuple):
    value: bytes
    key: bytes | None
    timestamp_ms: int | None
    headers: list


def compile_parser(fmt: str) -> Callable[[bytes], ParsedLine]:
    """A function line -> ParsedLine for `kera produce -f`; CliError on a line that does not
    match (naming the format), or on a format that cannot be read back."""
    tokens = _tokens(fmt, {f: None for f in READ_FIELDS})
    fields = [v.decode() for kind, v in tokens if kind == "field"]
    if len(set(fields)) != len(fields) or "s" not in fields:
        raise CliError(f"--format {fmt!r}: name %s (the value) once, and each other field at "
                       f"most once")
    for a, b in zip(tokens, tokens[1:]):
        if a[0] == b[0] == "field":
            raise CliError(f"--format {fmt!r}: fields %{a[1].decode()}%{b[1].decode()} need "
                           f"text between them to tell where one ends")
    return lambda line: _parse(tokens, fmt, line)


def _parse(tokens, fmt: str, line: bytes) -> ParsedLine:
    got: dict[str, bytes] = {}
    rest = line
    for i, (kind, v) in enumerate(tokens):
        if kind == "text":
            if not rest.startswith(v):
                raise CliError(f"line {line[:80]!r} does not match --format {fmt!r}")
            rest = rest[len(v):]
            continue
        after = tokens[i + 1][1] if i + 1 < len(tokens) else None
        # The last field takes the rest (up to a trailing text, found from the end).
        cut = (len(rest) if after is None else rest.rfind(after) if i + 2 == len(tokens)
               else rest.find(after))
        if after is not None and cut < 0:
            raise CliError(f"line {line[:80]!r} does not match --format {fmt!r}")
        got[v.decode()], rest = rest[:cut], rest[cut:]
    return ParsedLine(got["s"], got.get("k"), _timestamp(got.get("T"), line),
                      _headers(got.get("h", b""), line))


def _timestamp(text: bytes | None, line: bytes) -> int | None:
    if text is None or text == b"":
        return None
    if not text.isdigit():
        raise CliError(f"line {line[:80]!r}: %T must be milliseconds since the epoch, not "
                       f"{text[:30]!r}")
    return int(text)


def _headers(text: bytes, line: bytes) -> list:
    out = []
    for pair in text.split(b",") if text else []:
        key, sep, value = pair.partition(b"=")
        if not sep or not key:
            raise CliError(f"line {line[:80]!r}: %h is k=v,k=v, not {text[:60]!r}")
        out.append((key.decode(errors="replace"), value))
    return out
