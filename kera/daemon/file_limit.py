"""The open-file limit of kera's daemon processes: raised at start from the soft limit to the hard.

A daemon holds a descriptor per client connection and per peer (zmq sockets), per file it writes
or maps, and keeps the files of busy R=1 segments open up to a share of its limit
(kera.broker.tier_files.live_files_open_max). Many systems start processes with a soft limit of
1,024 under a much higher hard limit (systemd: 524,288). The soft limit is the process's own to
raise up to the hard one, which is what the JVM does for Kafka at start (-XX:+MaxFDLimit, on by
default) and Go does for every program; kera's daemons do the same, and say so in their log.

Only processes kera runs itself (`kera broker|backup|coordinator`), as for kera.daemon.gc_policy: the
client libraries leave their application's limits alone.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

# The soft limit is raised no higher than this many descriptors: Linux's default fs.nr_open
# (1,048,576), above which setrlimit fails; an unlimited hard limit is taken as this.
OPEN_FILES_MAX = 1 << 20


def tune_daemon() -> int:
    """Raise the soft open-file limit to the hard one (at most OPEN_FILES_MAX); the soft limit
    now. Call once at start, before the daemon serves. A refusal leaves the limit as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = OPEN_FILES_MAX if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_MAX)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as err:
        log.warning("open-file limit stays %d (raising it to %d was refused: %s); raise "
                    "`ulimit -n` for many connections or busy R=1 streams", soft, target, err)
        return soft
    log.info("open-file limit raised from %d to %d (hard limit %s)", soft, target,
             "unlimited" if hard == resource.RLIM_INFINITY else hard)
    return target
