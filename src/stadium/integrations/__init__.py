"""Adapters that let Stadium serve environments written for other frameworks, unchanged.

* :mod:`stadium.integrations.openenv`: an OpenEnv ``Environment`` subclass
  (pydantic Action/Observation/State, sync or async) becomes a Stadium environment
  that speaks OpenEnv's wire format (extra ``stadium-rl[openenv]``).
* :mod:`stadium.integrations.gymnasium`: a Gymnasium env (a registered id or a
  ``gymnasium.Env`` subclass) becomes a Stadium environment whose spaces are
  exported in ``GET /schema`` (extra ``stadium-rl[gym]``).

``stadium serve`` picks the adapter itself (see :func:`stadium._server.loader.load_target`);
nothing here is imported by ``import stadium``.
"""
