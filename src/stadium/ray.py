"""Stadium servers on a Ray cluster: ``stadium.ray.start(target, ...)``.

::

    import stadium, stadium.ray

    with stadium.ray.start("benchmark", address="10.0.0.1:6379") as d:  # one per node
        print(d.endpoints)                   # http://NODE_IP:PORT of every server
        pool = stadium.SessionPool(d, size=256)  # sessions spread over them

Needs Ray (``pip install 'stadium-rl[ray]'``); Ray is imported only when :func:`start`
runs. The same as ``stadium.launch(target, replicas=N, on="ray", ...)``; see
:mod:`stadium.deploy.ray_cluster` for placement (one server per node, or per N CPUs), how it
connects to Ray (it never starts a cluster unless told ``address="local"``) and stopping.
"""

from __future__ import annotations

from stadium.deploy.ray_cluster import RayDeployment, RayServer, start

__all__ = ["RayDeployment", "RayServer", "start"]
