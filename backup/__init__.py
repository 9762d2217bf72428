"""The kera backup daemon: stores replicas of brokers' virtual segments, in memory then on disk.

Modules: `store` (sans-IO core) over `replica` and `frames`; `meta` and `disk` (replica files);
`worker` (flusher/reader threads); `server` (the daemon; its coordinator session runs on
kera.daemon.coordinator_link).
"""
