#!/usr/bin/env bash
# OpenEnv's own live tests and example envs, run against OpenEnv 0.10's server and against
# `stadium serve`, side by side; prints a pass/fail table per test and exits 1 when a test
# passes on OpenEnv's server and not on Stadium (drift). Slow (minutes): not in `make test`.
#
#   scripts/openenv-peer-tests.sh [OPENENV_REPO]
#
# OPENENV_REPO: a checkout of github.com/meta-pytorch/OpenEnv, or its git directory (e.g. the
# mirror `fetch github:meta-pytorch/OpenEnv` makes). Its tests and envs are used; its `src/`
# is not: the installed openenv (0.10, `pip install 'stadium-rl[dev]'`) is.
# Suites: tests/envs/test_websockets.py, tests/envs/test_coding_env_integration.py (Docker
# replaced by a local server), tests/core/test_production_mode_routes.py,
# test_simulation_mode_preserves_api.py and test_web_interface.py (TestClient replaced by a
# live server; the last needs gradio, and smolagents for the REPL env), and the
# example envs coding_env, echo_env and the pre-MCP echo_env (commit 56f8922b) driven by
# OpenEnv's GenericEnvClient. PEER_STARTUP_S (default 90) bounds each server's start;
# PEER_SUITES="coding_env examples" runs only those suites.
# The real coding_env needs smolagents: the script installs it into PYTHON's environment
# when missing (without it, coding_env's tests fail on both servers alike).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
REPO="${1:-${OPENENV_REPO:-/work/.mirror/meta-pytorch+OpenEnv/repo}}"
PRE_MCP_ECHO="${PRE_MCP_ECHO:-56f8922b}"
SUITE_TIMEOUT="${SUITE_TIMEOUT:-1800}"

if [ -d "$REPO/.git" ]; then GIT=(git -C "$REPO"); else GIT=(git --git-dir="$REPO"); fi
"${GIT[@]}" rev-parse --verify -q HEAD >/dev/null || { echo "not an OpenEnv repository: $REPO" >&2; exit 2; }

WORK="$(mktemp -d -t openenv-peer.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/head" "$WORK/premcp" "$WORK/results"
# File by file (not `git archive`): a mirror may lack its largest blobs; those are skipped.
extract() {  # REV DEST PATH...
  local rev="$1" dest="$2"; shift 2
  "${GIT[@]}" ls-tree -r --name-only "$rev" -- "$@" | while read -r file; do
    mkdir -p "$dest/$(dirname "$file")"
    "${GIT[@]}" show "$rev:$file" >"$dest/$file" 2>/dev/null || { rm -f "$dest/$file"; echo "  (skipped $file: not in this copy)"; }
  done
}
extract HEAD "$WORK/head" tests/envs tests/core envs/coding_env envs/echo_env envs/connect4_env envs/repl_env
extract "$PRE_MCP_ECHO" "$WORK/premcp" envs/echo_env
echo "OpenEnv tests and envs at $("${GIT[@]}" rev-parse --short HEAD); pre-MCP echo_env at $PRE_MCP_ECHO"
# The real coding_env's executor: installed here (not a dependency of Stadium itself).
"$PY" -c 'import smolagents' 2>/dev/null || "$PY" -m pip install --quiet smolagents \
  || echo "warning: smolagents could not be installed: coding_env cannot run" >&2
echo "openenv $("$PY" -c 'import importlib.metadata as m; print(m.version("openenv"))'), stadium $("$PY" -c 'import stadium; print(stadium.__version__)')"

SUITES=(
  "coding_env:tests/envs/test_coding_env_integration.py"
  "production_mode:tests/core/test_production_mode_routes.py"
  "simulation_mode:tests/core/test_simulation_mode_preserves_api.py"
  "web_interface:tests/core/test_web_interface.py"
  "examples:$HERE/openenv_peer_examples.py"
  "websockets:tests/envs/test_websockets.py"
)
[ -n "${PEER_SUITES:-}" ] && read -r -a SUITES <<<"$(for s in "${SUITES[@]}"; do case " $PEER_SUITES " in *" ${s%%:*} "*) printf '%s ' "$s";; esac; done)"
export PEER_EXAMPLES="$WORK/head/envs=coding_env.server.app:app,$WORK/head=envs.echo_env.server.app:app,$WORK/premcp=envs.echo_env.server.app:app"
export PEER_STARTUP_S="${PEER_STARTUP_S:-90}"
for suite in "${SUITES[@]}"; do
  for server in openenv stadium; do
    name="${suite%%:*}"; path="${suite#*:}"
    [ -e "$path" ] || [ -e "$WORK/head/$path" ] || { echo "($name: $path not in this OpenEnv revision)"; continue; }
    echo "running $name against $server ..."
    (cd "$WORK/head" && PEER_SERVER="$server" PYTHONPATH="$WORK/head:$WORK/head/envs:$HERE" \
      timeout "$SUITE_TIMEOUT" "$PY" -m pytest -q -p openenv_peer_plugin -p no:cacheprovider \
        -o addopts="" -o asyncio_mode=auto --rootdir "$WORK/head" --junitxml "$WORK/results/$server-$name.xml" \
        "$path" >"$WORK/results/$server-$name.log" 2>&1) || true
  done
done

"$PY" - "$WORK/results" <<'EOF'
import sys, pathlib, xml.etree.ElementTree as ET
results = pathlib.Path(sys.argv[1])
table: dict[tuple[str, str], dict[str, str]] = {}
for xml in sorted(results.glob("*.xml")):
    server, suite = xml.stem.split("-", 1)
    for case in ET.parse(xml).iter("testcase"):
        test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        tags = {child.tag for child in case}
        outcome = ("fail" if tags & {"failure", "error"} else "skip" if "skipped" in tags
                   else "pass")
        table.setdefault((suite, test), {})[server] = outcome
drift = both = 0
width = max((len(f"{s} {t}") for s, t in table), default=10)
print(f"\n{'test'.ljust(width)}  openenv  stadium")
for (suite, test), row in sorted(table.items()):
    o, s = row.get("openenv", "-"), row.get("stadium", "-")
    mark = "  DRIFT" if o == "pass" and s != "pass" else ""
    drift += bool(mark)
    both += o == s == "pass"
    print(f"{f'{suite} {test}'.ljust(width)}  {o:7}  {s:7}{mark}")
passed = {srv: sum(r.get(srv) == "pass" for r in table.values()) for srv in ("openenv", "stadium")}
print(f"\n{len(table)} tests; passed: openenv {passed['openenv']}, stadium {passed['stadium']}; "
      f"both {both}; passing on OpenEnv only (drift): {drift}")
sys.exit(1 if drift else 0)
EOF
