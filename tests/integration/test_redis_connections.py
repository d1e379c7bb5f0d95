"""Redis through Sentinel, with a password and over TLS: the leases and the broker on private servers.

The servers are this machine's ``redis-server`` binary, started by the test on free ports (never the machine's
own Redis): one master with a password and a Sentinel that monitors it, and one TLS-only server with a CA
made here.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from pydantic import SecretStr

from store import errors, redis_client
from store.leases import LeaseManager
from store.settings import Settings
from worker.celery import configure

pytestmark = pytest.mark.integration

PASSWORD = "master-pass-5e1f0c"
SENTINEL_PASSWORD = "sentinel-pass-77aa"
MASTER = "lousho-master"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait(check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError("a private Redis server did not come up")
        time.sleep(0.1)


def _require(program: str, package: str) -> None:
    """Skip the test when ``program`` is missing; fail it in CI, where these tests must run."""
    if shutil.which(program) is None:
        reason = f"{program} is not installed (Debian's {package} package; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


def _server(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    _require("redis-server", "redis-server")
    with log.open("wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(["redis-server", *args], stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture
def sentinel_url(tmp_path: Path) -> Iterator[str]:
    """A master with a password and one Sentinel (with its own password) watching it; yields the Sentinel URL."""
    master, sentinel = _free_port(), _free_port()
    processes = [
        _server(
            [
                "--port",
                str(master),
                "--bind",
                "127.0.0.1",
                "--requirepass",
                PASSWORD,
                "--masterauth",
                PASSWORD,
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            tmp_path / "master.log",
        )
    ]
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {sentinel}\nbind 127.0.0.1\ndir {tmp_path}\nrequirepass {SENTINEL_PASSWORD}\n"
        f"sentinel monitor {MASTER} 127.0.0.1 {master} 1\nsentinel auth-pass {MASTER} {PASSWORD}\n"
    )
    processes.append(_server([str(conf), "--sentinel"], tmp_path / "sentinel.log"))
    try:
        watcher = redis.Redis(port=sentinel, password=SENTINEL_PASSWORD, socket_timeout=2)
        _wait(lambda: watcher.sentinel_get_master_addr_by_name(MASTER) is not None)
        yield f"sentinel://:{PASSWORD}@127.0.0.1:{sentinel}/0;sentinel://127.0.0.1:{_free_port()}/0"
    finally:
        for process in processes:
            process.kill()
            process.wait()


@pytest.fixture
def tls_url(tmp_path: Path) -> Iterator[str]:
    """A TLS-only server with a password and a certificate from a CA made here; yields its ``rediss://`` URL."""
    _require("openssl", "openssl")
    _require("redis-server", "redis-server")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=lousho-test-ca",
    )
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"
    )
    (tmp_path / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext",
    )
    port = _free_port()
    process = _server(
        [
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            str(tmp_path / "server.pem"),
            "--tls-key-file",
            str(tmp_path / "server.key"),
            "--tls-ca-cert-file",
            str(tmp_path / "ca.pem"),
            "--tls-auth-clients",
            "no",
            "--requirepass",
            PASSWORD,
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        tmp_path / "tls.log",
    )
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={tmp_path / 'ca.pem'}"
    try:
        _wait(lambda: redis.Redis.from_url(url, socket_timeout=2).ping())
        yield url
    finally:
        process.kill()
        process.wait()


def _roundtrip(settings: Settings) -> None:
    """A lease taken and released, and a message through the broker, on ``settings``' Redis."""
    leases = LeaseManager(redis_client.connect(settings, socket_timeout=5, socket_connect_timeout=5), 5000)
    lease = leases.acquire("redis-conn-1")
    assert lease is not None and leases.acquire("redis-conn-1") is None
    leases.release(lease)
    assert leases.acquire("redis-conn-1") is not None
    app = Celery("lousho-redis-test", set_as_current=False)
    configure(app, settings)
    with app.connection_for_write() as connection:
        queue = connection.SimpleQueue("lousho-redis-test")
        queue.put({"n": 1}, serializer="json")
        message = queue.get(timeout=10)
        assert message.payload == {"n": 1}
        message.ack()
        queue.close()
    app.close()


def test_leases_and_the_broker_work_through_sentinel(sentinel_url: str, settings: Settings) -> None:
    sentinel = settings.model_copy(
        update={
            "redis_url": sentinel_url,
            "broker_url": None,
            "redis_sentinel_master": MASTER,
            "redis_sentinel_password": SecretStr(SENTINEL_PASSWORD),
        }
    )
    _roundtrip(sentinel)
    transport, extra = redis_client.celery_broker_options(sentinel)
    assert transport == {"master_name": MASTER, "sentinel_kwargs": {"password": SENTINEL_PASSWORD}} and not extra
    # Without the master's name the URL is refused, not tried as a plain server.
    with pytest.raises(errors.ConfigurationError, match="LOUSHO_REDIS_SENTINEL_MASTER"):
        redis_client.connect(sentinel.model_copy(update={"redis_sentinel_master": None}))


def test_leases_and_the_broker_work_over_tls_with_a_password(tls_url: str, settings: Settings) -> None:
    tls = settings.model_copy(update={"redis_url": tls_url, "broker_url": None})
    _roundtrip(tls)
    _, extra = redis_client.celery_broker_options(tls)
    assert extra["broker_use_ssl"]["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    # A client that does not trust the server's CA is refused.
    untrusted = tls_url.split("?")[0]
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(untrusted, socket_timeout=2).ping()


def test_sentinel_urls_are_taken_apart_and_malformed_ones_refused_without_their_password() -> None:
    parsed = redis_client.parse_sentinel("sentinel://u:p%40ss@a:26380/3;sentinel://b")
    assert parsed.nodes == (("a", 26380), ("b", 26379)) and parsed.db == 3
    assert (parsed.username, parsed.password) == ("u", "p@ss")
    for bad in ("redis://a:1", "sentinel://", "sentinel://a:1/x"):
        with pytest.raises(errors.ConfigurationError) as refused:
            redis_client.parse_sentinel(bad)
        assert "p@ss" not in refused.value.message
    assert redis_client.tls_options("redis://a") is None
    options = redis_client.tls_options("rediss://a?ssl_cert_reqs=none")
    assert options is not None and options["ssl_cert_reqs"] == ssl.CERT_NONE
    with pytest.raises(errors.ConfigurationError):
        redis_client.tls_options("rediss://a?ssl_cert_reqs=maybe")
