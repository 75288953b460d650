#!/usr/bin/env bash
# The browser the page tests (tests/test_pages.py) drive: Debian's `chromium`, run by Playwright
# (the `dev` extra) with executable_path=/usr/bin/chromium; Playwright's own browser download is
# never used (PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1). See install-debs.sh.
exec bash "$(dirname "$0")/install-debs.sh" browser-deps tests/test_pages.py chromium:chromium
