"""Deterministic whole-cluster simulation (issue 4 item 6).

The sans-IO cores of the coordinator, brokers and backups, and the producer's and consumer's
bookkeeping, run in one process on a simulated clock, wired exactly as their servers wire them,
over a simulated network and disks that lose, delay, reorder (across connections), crash and
corrupt, all drawn from one seed. The guarantees of DESIGN.md are checked as
the run goes (tests/sim/checker.py); a failure names the seed, which replays the run:

    KERA_SIM_SEED=1234 pytest tests/sim -q          # one seed
    python -m tests.sim 1234 --trace 60 --log INFO  # the same, with deliveries and core logs

Modules (README.md has more): scheduler (clock + event queue), network (channels, faults),
shell (the kera.net.server loop, simulated), disk (a backup's files, flusher and reader), daemons
(coordinator, broker, backup: their real server classes on simulated I/O), clients (producers,
consumers, admin), probes (replica auditor, fuzzer), checker (the guarantees), cluster (a
cluster from a seed: faults, healing, final checks).
"""
