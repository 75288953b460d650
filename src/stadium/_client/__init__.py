"""The clients: ``AsyncClient`` (one session), ``Client`` and ``SessionPool`` (sync and many
sessions), batches, client-side balancing. Nothing here imports the server."""
