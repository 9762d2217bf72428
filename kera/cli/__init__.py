"""The `kera` command line: one module per command family."""
