#!/usr/bin/env bash
# What the emulated-cluster tests (tests/cluster) need, from Debian's packages: SLURM (slurm-wlm:
# slurmctld, slurmd and the client commands), munge, HAProxy, iproute2 and util-linux (ip,
# nsenter, unshare). See install-debs.sh.
exec bash "$(dirname "$0")/install-debs.sh" cluster-deps tests/cluster \
    slurmctld:slurm-wlm slurmd:slurm-wlm srun:slurm-wlm sinfo:slurm-wlm \
    munged:munge mungekey:munge haproxy:haproxy ip:iproute2 nsenter:util-linux unshare:util-linux
