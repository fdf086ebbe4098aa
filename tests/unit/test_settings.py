from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from payment_worker.settings import Settings, describe_error


def _refused(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> str:
    """The one line describing why Settings() refuses ``env`` (set on top of the test's)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValidationError) as info:
        Settings()
    return describe_error(info.value)


def test_defaults_are_sane(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "PAYMENT_WORKER_HOME"):
        monkeypatch.delenv(var, raising=False)
    s = Settings()
    assert s.database_url is None and s.redis_url is None
    assert s.task_time_limit < s.visibility_timeout
    assert s.retry_max_delay < s.visibility_timeout
    assert str(s.payment_worker_home) == ".payment-worker"


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("DATABASE_URL", "mysql://x/y"),
        ("DATABASE_URL", "not a url"),
        ("REDIS_URL", "http://127.0.0.1:6379"),
        ("LOCK_TTL_MS", "-5"),
        ("GATEWAY_URL", "ftp://x"),
        ("METRICS_PORT", "70000"),
        ("MAX_AMOUNT", str(2**63)),  # past the amount column's bigint
    ],
)
def test_bad_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    line = _refused(monkeypatch, {var: value})
    assert var in line
    assert "\n" not in line


@pytest.mark.parametrize(
    ("var", "below", "floor"),
    [
        ("LOCK_TTL_MS", "499", "500"),
        ("LIVENESS_INTERVAL_MS", "49", "50"),
        ("SWEEPER_INTERVAL", "0.09", "0.1"),
    ],
)
def test_a_period_below_its_floor_is_refused_and_the_floor_taken(
    monkeypatch: pytest.MonkeyPatch, var: str, below: str, floor: str
) -> None:
    """Below the floors a renewal, heartbeat or sweeper pass is a busy loop. The margin is 0
    so that no cross-field rule (which names LOCK_TTL_MS too) refuses it in the floor's stead."""
    monkeypatch.setenv("LOCK_SAFETY_MARGIN_MS", "0")
    line = _refused(monkeypatch, {var: below})
    assert var in line and f"greater than or equal to {floor}" in line, line
    monkeypatch.setenv(var, floor)
    Settings()


def _status_all(setting: str, value: str) -> subprocess.CompletedProcess[str]:
    """``payment-worker status --all`` with one setting and nothing else in its environment."""
    return subprocess.run(
        [sys.executable, "-m", "payment_worker.cli", "status", "--all"],
        env={setting: value, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_bad_database_url_one_line_exit_2() -> None:
    proc = _status_all("DATABASE_URL", "postgresql//broken")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "DATABASE_URL" in lines[0]
    assert "Traceback" not in proc.stderr


def test_rate_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_RATE_OVERRIDES", '{"acct-1": 5}')
    s = Settings()
    assert s.rate_for("acct-1") == 5
    assert s.rate_for("acct-2") == s.gateway_rate_per_second


def test_the_stall_bound_stays_above_a_holder_waiting_on_the_gateway() -> None:
    assert Settings().gateway_quiet_max_seconds == 27.0  # 10 + 2 x (2 + 5) + 3
    assert Settings(lock_max_stall_seconds=27.5).lock_max_stall_seconds == 27.5
    with pytest.raises(ValidationError, match="LOCK_MAX_STALL_SECONDS must be above"):
        Settings(lock_max_stall_seconds=27.0)
    with pytest.raises(ValidationError, match="LOCK_MAX_STALL_SECONDS must be above"):
        Settings(gateway_pacing_max_wait=200.0)  # the default stall bound is now too short
    quick = Settings(
        gateway_pacing_max_wait=0.1,
        gateway_connect_timeout=0.1,
        gateway_read_timeout=0.2,
        lock_max_stall_seconds=4.0,
        db_retry_max_seconds=1.0,
        db_pool_timeout=1.0,
    )
    assert quick.gateway_quiet_max_seconds == pytest.approx(3.7)


@pytest.mark.parametrize(
    "url", ["https://gateway.example.com", "http://10.0.0.5:8700", "http://gateway-sim:8700"]
)
def test_a_real_gateway_needs_its_secret(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.delenv("GATEWAY_CLIENT_SECRET", raising=False)
    line = _refused(monkeypatch, {"GATEWAY_URL": url})
    assert line.startswith("invalid setting GATEWAY_CLIENT_SECRET: required") and "\n" not in line
    monkeypatch.setenv("GATEWAY_CLIENT_SECRET", "s3cret-value")
    secret = Settings().gateway_client_secret
    assert secret is not None and secret.get_secret_value() == "s3cret-value"


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8700", "http://localhost:9000", "http://[::1]:8700"]
)
def test_the_local_simulator_needs_no_secret(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.delenv("GATEWAY_CLIENT_SECRET", raising=False)
    monkeypatch.setenv("GATEWAY_URL", url)
    secret = Settings().gateway_client_secret
    assert secret is not None and secret.get_secret_value() == "sim-secret"


@pytest.mark.parametrize(
    ("value", "parsed"), [("", None), ("auto", None), ("true", True), ("false", False)]
)
def test_log_json_auto(monkeypatch: pytest.MonkeyPatch, value: str, parsed: bool | None) -> None:
    monkeypatch.setenv("LOG_JSON", value)
    assert Settings().log_json is parsed


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("DATABASE_URL", "mysql://app:Hunter2-pw@db/pay"),
        ("DATABASE_URL", "postgresql://app:Hunter2-pw@db:notaport/pay"),
        ("REDIS_URL", "http://:Hunter2-pw@cache:6379/0"),
    ],
)
def test_a_bad_url_is_shown_without_its_password(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    line = _refused(monkeypatch, {var: value})
    assert var in line and ":***@" in line and "Hunter2-pw" not in line


def test_the_database_retry_bound_stays_well_below_the_stall_bound() -> None:
    s = Settings()
    assert (s.db_pool_size, s.db_pool_timeout, s.db_retry_max_seconds) == (10, 5.0, 10.0)
    assert s.db_pgbouncer is False
    assert Settings(lock_max_stall_seconds=60.0, db_retry_max_seconds=30.0).db_retry_max_seconds
    with pytest.raises(ValidationError, match="DB_RETRY_MAX_SECONDS must be at most half"):
        Settings(lock_max_stall_seconds=60.0, db_retry_max_seconds=31.0)
    with pytest.raises(ValidationError, match="DB_POOL_TIMEOUT must not exceed"):
        Settings(db_pool_timeout=11.0)
    with pytest.raises(ValidationError, match="db_pool_size"):
        Settings(db_pool_size=0)


@pytest.mark.parametrize(
    ("env", "var"),
    [
        # renewed every 400 ms, trusted for 200 ms after a renewal: lost before the first one
        ({"LOCK_TTL_MS": "1200", "LOCK_SAFETY_MARGIN_MS": "1000"}, "LOCK_SAFETY_MARGIN_MS"),
        ({"LOCK_TTL_MS": "3000", "LOCK_SAFETY_MARGIN_MS": "1001"}, "LOCK_SAFETY_MARGIN_MS"),
        # a crash record's retry countdown (up to 300 s) past half the visibility timeout
        (
            {
                "VISIBILITY_TIMEOUT": "599",
                "TASK_TIME_LIMIT": "500",
                "TASK_SOFT_TIME_LIMIT": "400",
                "RETRY_MAX_DELAY": "200",
            },
            "VISIBILITY_TIMEOUT",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], var: str
) -> None:
    line = _refused(monkeypatch, env)
    assert var in line and "\n" not in line


def test_the_edges_of_those_rules_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCK_TTL_MS", "3000")
    monkeypatch.setenv("LOCK_SAFETY_MARGIN_MS", "1000")
    monkeypatch.setenv("VISIBILITY_TIMEOUT", "600")
    monkeypatch.setenv("TASK_TIME_LIMIT", "500")
    monkeypatch.setenv("TASK_SOFT_TIME_LIMIT", "400")
    monkeypatch.setenv("RETRY_MAX_DELAY", "200")
    s = Settings()
    assert (s.lock_ttl_ms, s.visibility_timeout) == (3000, 600)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        # pydantic-settings decoded the JSON before any validator: a traceback, not a line
        ("{bad", "GATEWAY_RATE_OVERRIDES: expected a JSON object of account ids"),
        ("[1]", "GATEWAY_RATE_OVERRIDES: Input should be a valid dictionary"),
        # a rate of 0 divided by zero at the account's first request
        ('{"acct-1": 0}', 'GATEWAY_RATE_OVERRIDES["acct-1"]: Input should be greater than 0'),
        ('{"acct-1": -5}', 'GATEWAY_RATE_OVERRIDES["acct-1"]: Input should be greater than 0'),
        # lax mode read true as 1.0 requests/s
        ('{"acct-1": true}', 'GATEWAY_RATE_OVERRIDES["acct-1"]: Input should be a valid number'),
        # an override no batch's account id can match would silently never apply
        ('{"acct-1 ": 5}', "GATEWAY_RATE_OVERRIDES: 'acct-1 ' is no account id"),
        ('{"..": 5}', "GATEWAY_RATE_OVERRIDES: '..' is no account id"),
        (
            '{"acct-e\u0301": 5}',
            "GATEWAY_RATE_OVERRIDES: 'acct-e\u0301' is no account id a batch can name: must be "
            "in Unicode normalization form NFC",
        ),
    ],
)
def test_bad_rate_overrides_are_one_line(
    monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    line = _refused(monkeypatch, {"GATEWAY_RATE_OVERRIDES": value})
    assert line.startswith("invalid setting " + message), line
    assert "\n" not in line


def test_empty_values_mean_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    # compose's ${X:-} hands an empty string to the worker
    monkeypatch.setenv("GATEWAY_RATE_OVERRIDES", " ")
    monkeypatch.setenv("WORKER_CONCURRENCY", "")
    s = Settings()
    assert (s.gateway_rate_overrides, s.worker_concurrency) == ({}, None)


@pytest.mark.parametrize("var", ["SWEEPER_INTERVAL", "LOCK_MAX_STALL_SECONDS", "LOCK_WAIT_TIMEOUT"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_no_float_setting_takes_inf_or_nan(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    # SWEEPER_INTERVAL=inf ended the repair thread at its first wait (OverflowError)
    assert _refused(monkeypatch, {var: value}).startswith(f"invalid setting {var}: ")


@pytest.mark.parametrize("scheme", ["unix", "UNIX"])
def test_the_broker_takes_no_unix_socket_url(monkeypatch: pytest.MonkeyPatch, scheme: str) -> None:
    """kombu has no unix:// transport: a worker died at start with a KeyError's traceback."""
    line = _refused(monkeypatch, {"REDIS_URL": f"{scheme}:///tmp/redis.sock?db=0"})
    assert line.startswith("invalid settings: CELERY_BROKER_URL must be set"), line
    assert _refused(monkeypatch, {"CELERY_BROKER_URL": "unix:///tmp/redis.sock?db=1"}).startswith(
        "invalid setting CELERY_BROKER_URL: "
    )
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:6379/1")
    assert Settings().redis_url == f"{scheme}:///tmp/redis.sock?db=0"  # the app's may be one


def test_a_cross_field_rule_reads_as_one_sentence() -> None:
    with pytest.raises(ValidationError) as info:
        Settings(task_time_limit=99_999)
    assert describe_error(info.value) == (
        "invalid settings: TASK_TIME_LIMIT must be below VISIBILITY_TIMEOUT"
    )


def test_cli_bad_rate_overrides_one_line_exit_2() -> None:
    proc = _status_all("GATEWAY_RATE_OVERRIDES", "{oops")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "payment-worker: invalid setting GATEWAY_RATE_OVERRIDES: expected a JSON object of "
        'account ids and requests per second, e.g. {"acct-1": 5}'
    ], proc.stderr
