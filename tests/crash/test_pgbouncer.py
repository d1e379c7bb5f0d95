"""The hot path through PgBouncer in transaction mode: real workers whose every statement goes through a pooler.

PgBouncer hands each transaction whatever server connection is free, so nothing may rely on a session: no
prepared statement kept across transactions (``LOUSHO_DATABASE_PREPARED_STATEMENTS=false``), no session
setting, no advisory lock held between statements. Runs with tool batches, an approval and beat's sweeps must
finish with the checker clean while the pooler's own counters show the statements went through it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.support import checker, services
from tests.support.agents import run_input
from tests.support.cluster import Cluster, wait_until

pytestmark = pytest.mark.crash

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
#: Server connections PgBouncer may open to Postgres for the test database (the connection budget).
POOL_SIZE = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _quoted(value: str) -> str:
    """``value`` as a quoted value of a PgBouncer connection string (a quote inside is doubled)."""
    return "'" + value.replace("'", "''") + "'"


def _server_identity(url: str) -> tuple[int, str]:
    """Which Postgres answers at ``url``: the port it listens on and its cluster's system identifier."""
    with psycopg.connect(url, connect_timeout=2, prepare_threshold=None) as conn:
        row = conn.execute(
            "SELECT system_identifier::text, current_setting('port')::int FROM pg_control_system()"
        ).fetchone()
    assert row is not None
    return int(row[1]), str(row[0])


@pytest.fixture
def pgbouncer() -> Iterator[str]:
    """A private PgBouncer in transaction mode in front of the test database; yields its database URL.

    It points at the server of the test database's own URL (the embedded one when no URL is set), never at a
    fixed address: another server may hold a database of the same name.
    """
    if not Path(PGBOUNCER).exists():
        if os.environ.get("CI"):
            pytest.fail("pgbouncer is not installed (Debian's pgbouncer package; .ci/run installs it)")
        pytest.skip("pgbouncer is not installed (Debian's pgbouncer package)")
    server = make_url(services.test_database_url())
    user, database = server.username or "postgres", server.database or services.TEST_DATABASE
    # Outside pytest's private temporary folders: started as root, it drops to the postgres user, who must
    # reach its files.
    home = Path(tempfile.mkdtemp(prefix="lousho-pgbouncer-"))
    home.chmod(0o777)
    port = _free_port()
    password = server.password or ""
    (home / "users.txt").write_text(f'"{user}" "{str(password).replace(chr(34), chr(34) * 2)}"\n')
    target = (
        f"host={server.host or '127.0.0.1'} port={server.port or 5432} dbname={_quoted(database)}"
        f" user={_quoted(user)}" + (f" password={_quoted(str(password))}" if password else "")
    )
    (home / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"{database} = {target}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {home / 'users.txt'}\nadmin_users = {user}\n"
        f"pool_mode = transaction\ndefault_pool_size = {POOL_SIZE}\nmax_client_conn = 200\n"
        f"logfile = {home / 'pgbouncer.log'}\npidfile = {home / 'pgbouncer.pid'}\n"
    )
    for path in home.iterdir():
        path.chmod(0o666)
    as_user = ["-u", "postgres"] if os.geteuid() == 0 else []
    process = subprocess.Popen(
        [PGBOUNCER, *as_user, str(home / "pgbouncer.ini")], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    url = f"postgresql://{user}@127.0.0.1:{port}/{database}"

    def answers() -> bool:
        try:
            with psycopg.connect(url, connect_timeout=2, prepare_threshold=None) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    try:
        wait_until(answers, 10, "pgbouncer accepting connections")
        direct = server.set(drivername="postgresql").render_as_string(hide_password=False)
        assert _server_identity(url) == _server_identity(direct), "the pooler reaches another server"
        yield url
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(home, ignore_errors=True)


def _transactions(pooler_url: str) -> int:
    """Transactions PgBouncer passed to the test database (its admin console's ``SHOW STATS``)."""
    admin = pooler_url.rsplit("/", 1)[0] + "/pgbouncer"
    with psycopg.connect(admin, autocommit=True, prepare_threshold=None) as conn:
        cursor = conn.execute("SHOW STATS")
        columns = [column.name for column in cursor.description or ()]
        rows = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
    return sum(int(row["total_xact_count"]) for row in rows if row["database"] == services.TEST_DATABASE)


def test_runs_with_batches_an_approval_and_the_sweeps_finish_through_pgbouncer_in_transaction_mode(
    make_cluster: Callable[..., Cluster], pgbouncer: str
) -> None:
    cluster = make_cluster(extra_env={"LOUSHO_DATABASE_URL": pgbouncer, "LOUSHO_DATABASE_PREPARED_STATEMENTS": "false"})
    before = _transactions(pgbouncer)
    cluster.start_worker("w1", concurrency=2)
    cluster.start_beat()
    runs = [f"pgb-{uuid.uuid4().hex[:8]}" for _ in range(6)]
    started = time.monotonic()
    for run_id in runs:
        cluster.send(
            "chaos",
            run_id,
            run_input(
                run_id, turns=4, calls="3,2", sleep="20-60", model=20, **({"gate": "1.0"} if run_id == runs[0] else {})
            ),
        )
    wait_until(lambda: cluster.approve_pending("chaos") > 0, 20, "the gated call to wait for approval")
    cluster.wait_finished(runs, timeout=90)
    took = time.monotonic() - started
    through = _transactions(pgbouncer) - before
    report = checker.check(cluster.database_url, cluster.log_path, expected=runs, faults=cluster.faults)
    checker.print_report(report, "through PgBouncer (transaction mode)")
    print(
        f"pgbouncer: {len(runs)} runs (one paused for an approval) finished in {took:.1f} s with beat's sweeps; "
        f"{through} transactions through a pool of {POOL_SIZE} server connections"
    )
    checker.assert_clean(report)
    assert through > 6 * len(runs)  # every step's claim and save went through the pooler
