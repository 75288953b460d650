#!/usr/bin/env bash
# What the container tests (tests/container) need: Debian's Podman 4.3, runc and debootstrap
# (see install-debs.sh), and the Podman settings found to work on these machines (Debian 12, hybrid
# cgroups, no systemd; see shared/CLUSTER.md):
#   runtime = "runc"          crun 1.8 fails on hybrid cgroups
#   netns = "none"            containers get no network unless asked; the tests and
#                             stadium.deploy.podman use `--network host` (no NAT rules needed)
#   default_ulimits = [...]   explicit open-file and process limits for containers
# They go into a drop-in, /etc/containers/containers.conf.d/50-stadium.conf, written once, with
# only the keys no containers.conf (system-wide or root's) sets already: a user's own
# configuration is never changed. Not root, or no Podman after the install: exits 0 (the tests
# then skip with the reason).
set -euo pipefail

bash "$(dirname "$0")/install-debs.sh" container-deps tests/container \
    podman:podman runc:runc debootstrap:debootstrap

[[ $(id -u) -eq 0 ]] || exit 0
command -v podman >/dev/null 2>&1 || exit 0

dropin=/etc/containers/containers.conf.d/50-stadium.conf
[[ -e $dropin ]] && exit 0
# Podman 4.3 reads containers.conf, then containers.conf.d/*.conf (later files win); root's
# ~/.config/containers/containers.conf overrides both. A key any of them sets is left alone.
confs=()
for conf in /usr/share/containers/containers.conf /etc/containers/containers.conf \
    /etc/containers/containers.conf.d/*.conf "${HOME:-/root}/.config/containers/containers.conf"; do
    [[ -f $conf ]] && confs+=("$conf")
done
unset_key() {  # true when no configuration file sets key $1
    [[ ${#confs[@]} -eq 0 ]] || ! grep -Eq "^[[:space:]]*$1[[:space:]]*=" "${confs[@]}"
}
containers="" engine=""
unset_key default_ulimits && containers+=$'default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]\n'
unset_key netns && containers+=$'netns = "none"\n'
unset_key runtime && engine+=$'runtime = "runc"\n'
if [[ -z $containers$engine ]]; then
    echo "container-deps: runtime, netns and default_ulimits are already set; $dropin not written"
    exit 0
fi
mkdir -p "$(dirname "$dropin")"
{
    echo "# Written by Stadium's scripts/install-container-deps.sh: Podman settings that work on a"
    echo "# Debian 12 host without systemd (hybrid cgroups). Remove this file to undo."
    [[ -n $containers ]] && printf '[containers]\n%s' "$containers"
    [[ -n $containers && -n $engine ]] && echo
    [[ -n $engine ]] && printf '[engine]\n%s' "$engine"
} >"$dropin"
echo "container-deps: wrote $dropin"
