"""Running Stadium beyond one process: deployment files, router configurations, launchers.

* :mod:`stadium.deploy.deployment` — the deployment file: where a deployment's
  nodes (and router, if any) are, written by launchers and read by clients,
  routers and ``stadium bench``;
* :mod:`stadium.deploy.haproxy` — an ``haproxy.cfg`` for a set of nodes
  (``stadium router``);
* :mod:`stadium.deploy.slurm` — ``stadium slurm``: one server per SLURM node;
* :mod:`stadium.deploy.kubernetes` — ``stadium deploy kubernetes``: manifests;
* :mod:`stadium.deploy.launch` — :func:`stadium.launch`, one Python API over the
  engines: :mod:`~stadium.deploy.local` (processes here), SLURM,
  :mod:`~stadium.deploy.ray_cluster`, :mod:`~stadium.deploy.podman`; each returns a
  :class:`~stadium.deploy.running.Running`.

Nothing here imports the server: these modules write files and run commands.
"""
