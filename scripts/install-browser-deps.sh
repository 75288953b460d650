#!/usr/bin/env bash
# Install the browser the page tests (tests/test_pages.py) drive: Debian's `chromium` package,
# run by Playwright (the `dev` extra) with executable_path=/usr/bin/chromium. Playwright's own
# browser download is never used (PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1; it is often unreachable).
# Idempotent and quick when chromium is there. Not root, or no apt-get: prints why and exits 0
# (the page tests then skip with the reason).
set -euo pipefail

if command -v chromium >/dev/null 2>&1 || [[ -x /usr/bin/chromium ]]; then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "browser-deps: not root; skipping the install of chromium (tests/test_pages.py will skip)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "browser-deps: no apt-get; install chromium by hand (tests/test_pages.py will skip)"
    exit 0
fi
echo "browser-deps: installing chromium"
export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists once (an empty or stale list finds nothing), then install.
if [[ -z $(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -mmin -1440 2>/dev/null | head -1) ]]; then
    apt-get update -qq
fi
if ! apt-get install -y -qq --no-install-recommends chromium >/dev/null; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
echo "browser-deps: installed"
