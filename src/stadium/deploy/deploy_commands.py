"""``stadium deploy``: start or describe deployments on an engine.

Subcommands (each in its engine's module, imported only when used):

* ``stadium deploy kubernetes TARGET`` — print Kubernetes manifests;
* the other engines (local processes, Podman, Ray, SLURM) are driven from Python
  through :func:`stadium.launch`, and SLURM also by ``stadium slurm``.
"""

from __future__ import annotations

from typing import Any

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def deploy() -> None:
    """Deploy Stadium servers: manifests and launchers for real engines."""


@deploy.command()
@click.argument("target")
@click.option("--name", default="stadium", show_default=True,
              help="Name of the objects (pods are NAME-0, NAME-1 ...).")  # fmt: skip
@click.option("--namespace", help="Namespace of every object [kubectl's current one].")
@click.option("--replicas", default=2, show_default=True, type=int, help="Pods.")
@click.option("--image", default="stadium:latest", show_default=True,
              help="Image with `stadium` (and the env's code) installed.")  # fmt: skip
@click.option("--image-pull-policy", default="IfNotPresent", show_default=True,
              type=click.Choice(["Always", "IfNotPresent", "Never"]))  # fmt: skip
@click.option("--port", default=8000, show_default=True, type=int, help="Servers' port.")
@click.option("--cpu", default="1", show_default=True,
              help="CPU request per pod (2, 1.5, 500m); WORKERS follows it.")  # fmt: skip
@click.option("--cpu-limit", help="CPU limit per pod [the request].")
@click.option("--memory", default="1Gi", show_default=True, help="Memory request per pod.")
@click.option("--memory-limit", help="Memory limit per pod [the request].")
@click.option("--workers", type=int, help="Worker processes per pod [the CPU request, rounded].")
@click.option("--max-sessions", type=int,
              help="Sessions per pod (MAX_CONCURRENT_ENVS) [serve's default].")  # fmt: skip
@click.option("--drain-timeout", type=float,
              help="Seconds a pod drains on SIGTERM; grace follows [serve's].")  # fmt: skip
@click.option("--prestop-delay", default=5.0, show_default=True, type=float,
              help="Seconds from a pod's removal to its SIGTERM; 0 off.")  # fmt: skip
@click.option("--auth-secret", help="Secret holding the bearer token (STADIUM_AUTH_TOKEN).")
@click.option("--auth-secret-key", default="token", show_default=True,
              help="Key of the token in --auth-secret.")  # fmt: skip
@click.option("--serve-arg", "serve_args", multiple=True,
              help="An extra argument for `stadium serve` (repeatable).")  # fmt: skip
@click.option("--workload", type=click.Choice(["statefulset", "deployment"]),
              default="statefulset", show_default=True,
              help="StatefulSet: stable pod names, resumed sessions routed back through "
              "the gateway. Deployment: surge rollouts, no per-pod routes.")  # fmt: skip
@click.option("--gateway", help="Gateway API Gateway the HTTPRoute attaches to.")
@click.option("--gateway-namespace",
              help="The Gateway's namespace (its listeners must allow routes from this one) "
              "[the route's].")  # fmt: skip
@click.option("--hostname", "hostnames", multiple=True,
              help="Host name the HTTPRoute serves (repeatable) [the Gateway's].")  # fmt: skip
@click.option("--no-route", is_flag=True, help="No HTTPRoute (no Gateway API in the cluster).")
@click.option("--route-timeout", default=0.0, show_default=True, type=float,
              help="The route's request timeout in seconds; 0: none (long episodes).")  # fmt: skip
@click.option("--run-as-user", default=10001, show_default=True, type=int,
              help="Non-root user id the server runs as (the Containerfile's).")  # fmt: skip
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True),
              help="Write the manifests here instead of standard output.")  # fmt: skip
def kubernetes(target: str, workload: str, no_route: bool, serve_args: tuple[str, ...],
               hostnames: tuple[str, ...], output: str | None, **options: Any) -> None:  # fmt: skip
    """Print Kubernetes manifests serving TARGET: a StatefulSet (or Deployment),
    a headless Service (Stadium's clients balance over its pods), a ClusterIP
    Service, a PodDisruptionBudget and Gateway API HTTPRoutes (new sessions to
    the Service, ?stadium_node=POD back to that pod). Apply with kubectl apply -f.
    """
    from pathlib import Path

    from stadium.deploy.kubernetes import KubernetesOptions, Workload, render

    opts = KubernetesOptions(
        target=target,
        workload=Workload(workload),
        route=not no_route,
        serve_args=serve_args,
        hostnames=hostnames,
        **options,
    )
    text = render(opts)
    if output is None:
        click.echo(text, nl=False)
    else:
        Path(output).write_text(text)
        click.echo(f"wrote {output}", err=True)


__all__ = ["deploy"]
