#!/usr/bin/env bash
# The test suite on a fresh machine: builds .venv, then runs pytest against the
# embedded PostgreSQL and the real CPU model, on two pytest-xdist workers: the
# tests of a file run on one worker, so a module's servers start once (the
# live Airflow deployment and the loaded vLLM each serve one file). Extra
# arguments go to pytest after these, so `-n 0` runs in one process.
BI_EXTRA=dev source "$(dirname "$0")/_venv.sh"
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  # The dashboard's browser tests drive Debian's Chromium (no browser download).
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "warning: could not install chromium; browser tests will fail" >&2
fi
if ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  # The ledger, worker and chaos tests also run through Debian's PgBouncer in transaction mode.
  (apt-get install -y -qq pgbouncer >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq pgbouncer >/dev/null)) \
    || echo "warning: could not install pgbouncer; the PgBouncer runs will be skipped" >&2
fi
set +e
python -m pytest -n 2 --dist loadfile "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
