#!/usr/bin/env bash
# Go, for the Gateway API checks of tests/test_kubernetes.py: `go mod download` fetches the
# Gateway API CRDs from the Go module proxy (any Go works, Debian 12's 1.19 included; a newer
# Go already on PATH is used as it is). See install-debs.sh.
exec bash "$(dirname "$0")/install-debs.sh" k8s-deps tests/test_kubernetes.py go:golang-go
