"""The kera broker (imports as kera.broker).

`core.Broker` is the sans-IO state machine (streams, groups, segments, virtual logs); `server`
is the daemon loop around it (`kera broker`, or `python -m kera.broker`). See README.md here.
"""
