"""The kera backup daemon: stores replicas of brokers' virtual segments, in memory then on disk.

Modules: `store` (sans-IO core) over `replica` and `frames`; `meta` and `disk` (replica files);
`worker` (flusher/reader threads); `registration` (coordinator link); `server` (the daemon).
"""
