"""Durable sessions (``--durable``): :mod:`.records` says what a session writes and when,
:mod:`.session_store` where it is kept (:class:`~.session_store.SessionStore`)."""
