#!/usr/bin/env bash
# Install what the emulated-cluster tests (tests/cluster) need: SLURM (slurmctld, slurmd and the
# client commands), munge, HAProxy and iproute2/util-linux (ip, nsenter, unshare), all from
# Debian's packages. Idempotent and quick when everything is there (checks with `command -v`).
# Not root, or no apt-get: prints why and exits 0 (the cluster tests then skip with a reason).
set -euo pipefail

need=()
for pair in slurmctld:slurmctld slurmd:slurmd srun:slurm-client sinfo:slurm-client \
    munged:munge mungekey:munge haproxy:haproxy ip:iproute2 nsenter:util-linux \
    unshare:util-linux; do
    cmd=${pair%%:*} pkg=${pair#*:}
    if ! command -v "$cmd" >/dev/null 2>&1 && [[ ! -x /usr/sbin/$cmd ]]; then
        [[ " ${need[*]-} " == *" $pkg "* ]] || need+=("$pkg")
    fi
done
if [[ ${#need[@]} -eq 0 ]]; then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "cluster-deps: not root; skipping the install of ${need[*]} (tests/cluster will skip)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "cluster-deps: no apt-get; install ${need[*]} by hand (tests/cluster will skip)"
    exit 0
fi
# slurm-wlm pulls in slurmctld, slurmd and slurm-client.
case " ${need[*]} " in *" slurm"*) need+=(slurm-wlm) ;; esac
echo "cluster-deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists once (an empty or stale list finds nothing), then install.
if [[ -z $(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -mmin -1440 2>/dev/null | head -1) ]]; then
    apt-get update -qq
fi
if ! apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
echo "cluster-deps: installed"
