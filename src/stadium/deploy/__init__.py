"""Running Stadium beyond one process: deployment files, router configurations, launchers.

* :mod:`stadium.deploy.deployment` — the deployment file: where a deployment's
  nodes (and router, if any) are, written by launchers and read by clients,
  routers and ``stadium bench``;
* :mod:`stadium.deploy.haproxy` — an ``haproxy.cfg`` for a set of nodes
  (``stadium router``).

Nothing here imports the server: these modules write files and run commands.
"""
