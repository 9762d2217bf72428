"""kcat-style line formats (kera.cli.line_format): what `consume -f` prints, `produce -f` reads."""

import pytest

from kera.cli.line_format import ParsedLine, compile_format, compile_parser
from kera.cli.output import CliError
from kera.codec.position import Record


def record(**kw) -> Record:
    base = dict(key=b"k", value=b"v", timestamp=1_700_000_000_123_000, stream="s", streamlet=2,
                group=3, offset=4, headers=(("a", b"1"), ("b", b"2")), number=9)
    return Record(**{**base, **kw})


def test_a_format_prints_every_field_and_escape():
    line = compile_format(r"%t/%S/%p/%g/%o/%n/%T/%k/%h/%s 100%%\t\n")(record())
    assert line == b"s/2/2/3/4/9/1700000000123/k/a=1,b=2/v 100%\t\n"


@pytest.mark.parametrize("fmt", [r"%T\t%h\t%k\t%s", r"%k=%s", r"[%h] %s", r"%T|%s"])
def test_what_a_format_prints_it_reads_back(fmt):
    r = record(value=b"a value|with=signs")
    parsed = compile_parser(fmt)(compile_format(fmt)(r))
    assert parsed.value == r.value
    assert parsed.key == (r.key if "%k" in fmt else None)
    assert parsed.timestamp_ms == (r.timestamp // 1000 if "%T" in fmt else None)
    assert parsed.headers == (list(r.headers) if "%h" in fmt else [])


def test_empty_fields_mean_no_timestamp_and_no_headers():
    assert compile_parser(r"%T\t%h\t%s")(b"\t\tv") == ParsedLine(b"v", None, None, [])


@pytest.mark.parametrize("fmt,why", [
    ("%k", "name %s"), ("%s%k", "need text between"), ("%s %s", "name %s"),
    ("%o %s", "unknown field %o"), ("%x", "unknown field %x")])
def test_a_format_that_cannot_be_read_back_is_refused(fmt, why):
    with pytest.raises(CliError, match=why):
        compile_parser(fmt)


@pytest.mark.parametrize("line,why", [
    (b"no tab here", "does not match"), (b"12x\tv", "%T must be milliseconds")])
def test_a_line_that_does_not_match_is_refused_by_name(line, why):
    with pytest.raises(CliError, match=why):
        compile_parser(r"%T\t%s")(line)


def test_bad_headers_are_refused():
    with pytest.raises(CliError, match="k=v,k=v"):
        compile_parser(r"%h %s")(b"novalue v")
