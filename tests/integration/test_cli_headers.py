"""`kera produce --header/--compression` and `kera consume -f %h`: headers set on the command
line come back on every record, through compressed chunks, and tombstones print as empty."""

from kera.cli.local import LocalCluster
from kera.producer import Producer

from test_cli import kera  # the same subprocess runner (rootdir-less test modules)


def test_produce_headers_and_compression_then_consume_format(tmp_path):
    with LocalCluster(tmp_path, brokers=1, backups=0, log_level="WARNING") as cluster:
        boot = cluster.bootstrap
        assert kera("stream", "create", "hdrs", "--streamlets", "1", bootstrap=boot).returncode == 0
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
