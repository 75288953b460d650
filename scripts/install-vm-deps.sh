#!/usr/bin/env bash
# What --isolation vm needs (tests/isolation/test_vm.py): QEMU (Debian's qemu-system-x86, with
# its microvm machine), lz4 (to unpack the guest kernel into an ELF QEMU boots directly) and a
# guest kernel (Debian's linux-image-cloud-amd64: installed as a file under /boot, never booted
# by this machine). Installed when root and missing; a no-op otherwise (the vm tests then skip
# with the reason).
set -euo pipefail

bash "$(dirname "$0")/install-debs.sh" vm-deps tests/isolation/test_vm.py \
    qemu-system-x86_64:qemu-system-x86 lz4:lz4
if compgen -G "/boot/vmlinuz-*-cloud-amd64" >/dev/null; then
    exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "vm-deps: not root or no apt-get; install linux-image-cloud-amd64 by hand (tests/isolation/test_vm.py will skip)"
    exit 0
fi
echo "vm-deps: installing linux-image-cloud-amd64 (the guest kernel)"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends linux-image-cloud-amd64 >/dev/null \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends linux-image-cloud-amd64 >/dev/null; }
echo "vm-deps: installed"
