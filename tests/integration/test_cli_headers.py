"""`kera produce --header/--compression/--format` and `kera consume -f`: headers set on the
command line come back on every record, through compressed chunks, and tombstones print as
empty; per-line timestamps, headers and keys read by `produce -f` print back the same."""

from kera.cli.local import LocalCluster
from kera.producer import Producer

from test_cli import kera  # the same subprocess runner (rootdir-less test modules)


def test_produce_headers_and_compression_then_consume_format(tmp_path):
    with LocalCluster(tmp_path, brokers=1, backups=0, log_level="WARNING") as cluster:
        boot = cluster.bootstrap
        assert kera("stream", "create", "hdrs", "--streamlets", "1", bootstrap=boot).returncode == 0
        assert kera("stream", "create", "lines", "--streamlets", "1", bootstrap=boot).returncode == 0
        produced = kera("produce", "hdrs", "-H", "app=cli", "-H", "v=2", "-z", "zstd",
                        bootstrap=boot, input="a\nb\n")
        assert produced.returncode == 0, produced.stderr
        with Producer(boot) as p:
            p.send("hdrs", None, key=b"gone")
        out = kera("consume", "hdrs", "--from", "earliest", "--timeout-s", "2",
                   "-f", r"%k|%s|%h\n", bootstrap=boot)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == ["|a|app=cli,v=2", "|b|app=cli,v=2", "gone||"]
        bad = kera("produce", "hdrs", "-H", "novalue", bootstrap=boot, input="x\n")
        assert bad.returncode == 1 and "--header must be KEY=VALUE" in bad.stderr

        # Per-line timestamps, headers and keys: what consume -f prints, produce -f reads back.
        fmt = r"%T\t%h\t%k\t%s"
        lines = ["1700000000123\ttrace=a1,app=x\tk1\tfirst value", "1700000000456\t\tk2\tsecond\tvalue",
                 "1700000000789\tonly=1\t\tno key"]
        produced = kera("produce", "lines", "-f", fmt, bootstrap=boot, input="\n".join(lines) + "\n")
        assert produced.returncode == 0, produced.stderr
        out = kera("consume", "lines", "--from", "earliest", "--timeout-s", "2", "-f", fmt + r"\n",
                   bootstrap=boot)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == lines
        bad = kera("produce", "lines", "-f", fmt, bootstrap=boot, input="notatime\t\tk\tv\n")
        assert bad.returncode == 1 and "%T must be milliseconds" in bad.stderr
