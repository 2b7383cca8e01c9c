"""Failover to a promoted standby (issue 44): the test PostgreSQL gets a synchronous
streaming replica (``scripts/services standby``); a relay, a consumer and a process that
stages events connect with ``host=A,B`` and ``target_session_attrs=read-write``, each
session with ``synchronous_commit`` on; mid-stream the primary is SIGKILLed with its
backends (a machine that dies) and the standby promoted. Every event whose commit the
stager saw succeed is handled, and handled once: the relay's lost marks and claims only
republish, which the inbox absorbs. The primary comes back afterwards as it was (the
promoted standby is deleted), so the tests after this one run on it."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.parse

import psycopg
import pytest
from django.db import connections

from tests.support import (
    delete_queue,
    manage_command,
    relay_env,
    services,
    services_output,
    stop,
    unique_destination,
    wait_until,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.disrupts, pytest.mark.slow]

#: Stages one event per transaction for ``argv[1]`` seconds, printing the event id of each
#: commit that returned; a commit whose outcome the failover hid (an error at COMMIT) is
#: printed as ``unknown``: that event may or may not exist, and nothing is asserted of it.
STAGER = """
import sys, time
import django
django.setup()
from django.db import OperationalError, InterfaceError, close_old_connections, transaction
from django_outbox import stage
destination, seconds = sys.argv[1], float(sys.argv[2])
deadline, n = time.monotonic() + seconds, 0
while time.monotonic() < deadline:
    n += 1
    try:
        with transaction.atomic():
            row = stage("failover.tick", {"n": n}, destination=destination)
            event_id = str(row.event_id)
        print(event_id, flush=True)
    except (OperationalError, InterfaceError):
        print("unknown", flush=True)
        close_old_connections()
        from django.db import connection
        connection.close()
        time.sleep(0.2)
    time.sleep(0.01)
"""


def failover_url(synchronous_commit: str) -> str:
    """The test database on the primary and the standby, read-write wanted; with
    ``synchronous_commit`` on, the standby has each commit before it returns."""
    url = re.search(r"OUTBOX_FAILOVER_DATABASE_URL='([^']+)'", services_output("standby", "env"))
    assert url, "scripts/services standby env printed no URL"
    name = connections["default"].settings_dict["NAME"]
    base = url.group(1).replace("/outbox?", f"/{name}?")
    options = urllib.parse.quote(f"-c synchronous_commit={synchronous_commit}")
    return f"{base}&options={options}"


@pytest.fixture(params=["on", "local"])
def standby(request):
    """The failover URL, its sessions' commits synchronous with the standby ("on") or
    not ("local": the primary's own disk only, as with asynchronous replication)."""
    services("standby", "start")
    try:
        yield failover_url(request.param)
    finally:
        connections.close_all()
        services("standby", "stop")
        services("start", "postgres")


def handled(url: str, destination: str) -> dict[str, tuple[int, float]]:
    """Each event of ``destination`` the consumer handled: how many times, and when it
    was staged (epoch seconds), read from whichever server is the primary."""
    parsed = urllib.parse.urlparse(url)
    hosts = [netloc.rsplit(":", 1) for netloc in parsed.netloc.split("@", 1)[1].split(",")]
    with psycopg.connect(
        host=",".join(host for host, _ in hosts),
        port=",".join(port for _, port in hosts),
        user="postgres",
        dbname=parsed.path.lstrip("/"),
        target_session_attrs="read-write",
    ) as connection:
        rows = connection.execute(
            "SELECT d.event_id::text, count(*), extract(epoch FROM min(m.created_at))::float8 "
            "FROM testapp_delivery d JOIN django_outbox_outboxmessage m USING (event_id) "
            "WHERE m.destination = %s GROUP BY d.event_id",
            [destination],
        ).fetchall()
    return {event: (count, staged) for event, count, staged in rows}


def start(database_url: str, *command: str) -> subprocess.Popen[str]:
    """``command`` (argv) in the background, on the failover URL."""
    return subprocess.Popen(
        list(command),
        env={**relay_env(), "DATABASE_URL": database_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_promoted_standby_loses_no_committed_event_and_handles_none_twice(standby):
    destination = unique_destination("failover")
    relay = start(standby, *manage_command("run_outbox_relay"))
    consumer = start(
        standby,
        *manage_command("run_outbox_consumer", "--queue", destination),
        *("--handler", "tests.testapp.handlers.record", "--consumer", "failover"),
    )
    stager = start(standby, sys.executable, "-c", STAGER, destination, "20")
    synchronous = "synchronous_commit%3Don" in standby
    try:
        wait_until(  # events flow: staged, published, handled
            lambda: len(handled(standby, destination)) >= 30, timeout=60, what="30 handled"
        )
        failed_over_at = time.time()
        services("standby", "failover")
        out, err = stager.communicate(timeout=120)
        assert stager.returncode == 0, err
        committed = {line for line in out.split() if line != "unknown"}
        counts = (
            wait_until(
                lambda: (found := handled(standby, destination)).keys() >= committed and found,
                timeout=120,
                what="every committed event handled after the failover",
            )
            if synchronous
            else _settled(standby, destination)
        )
    finally:
        for process in (stager, consumer, relay):
            if process.poll() is None:
                stop(process)
        delete_queue(destination)
    after = [staged for _, staged in counts.values() if staged > failed_over_at]
    assert len(after) > 20 and len(counts) - len(after) >= 30, out  # before and after it
    assert {event: n for event, (n, _) in counts.items() if n != 1} == {}
    lost = committed - counts.keys()
    print(
        f"synchronous_commit {'on' if synchronous else 'local'}: {len(committed)} committed, "
        f"{len(after)} after the failover, {len(counts) - len(after)} before, {len(lost)} lost"
    )
    if synchronous:
        assert lost == set()


def _settled(url: str, destination: str) -> dict[str, tuple[int, float]]:
    """What the consumer handled once nothing new was handled for 5 s: with commits
    local to the primary, an event the stager saw committed may be gone with it."""
    last: dict[str, tuple[int, float]] = {}
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < 5:
        time.sleep(0.5)
        found = handled(url, destination)
        if found != last:
            last, quiet_since = found, time.monotonic()
    return last
