#!/usr/bin/env bash
# A PostgreSQL server for the tests, on a Debian machine where we are root (CI). Installs it
# only if no server is installed, starts the cluster unless it runs, sets the password of the
# postgres role, and prints the SQLAlchemy URL of the server on stdout (all else on stderr).
# Safe to run again, and on a machine whose server already runs.
# Everything but the URL goes to stderr, and no command keeps a copy of the caller's stdout:
# a server started here would otherwise hold the pipe of `url=$(bash .ci/postgres.sh)` open
# and the caller would wait for ever.
set -euo pipefail
exec 3>&1 1>&2

if ! compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql 3>&-
fi

version=$(find /usr/lib/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' | sort -V | tail -n 1)
if ! pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main"' | grep -q .; then
    pg_createcluster "$version" main 3>&-
fi
if ! pg_ctlcluster "$version" main status >/dev/null; then
    pg_ctlcluster "$version" main start 3>&-
fi
port=$(pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main" { print $3 }')

for _ in $(seq 30); do
    pg_isready -q -h 127.0.0.1 -p "$port" && break
    sleep 1
done
pg_isready -h 127.0.0.1 -p "$port"
(cd / && runuser -u postgres -- psql -q -p "$port" -c "ALTER ROLE postgres PASSWORD 'postgres'")

echo "postgresql+psycopg://postgres:postgres@127.0.0.1:$port/postgres" >&3
