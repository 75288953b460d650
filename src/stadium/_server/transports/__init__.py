"""The server's I/O layers: each carries bytes to and from the core and the sessions."""
