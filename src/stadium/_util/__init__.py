"""Process-level helpers shared by the server and the load generators (no protocol)."""
