"""Running the alembic migrations from code (``payment-worker db upgrade``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

ROOT = Path(__file__).resolve().parents[2]


def alembic_config(url: str | None = None) -> Config:
    """The project's alembic config; ``url`` (SQLAlchemy form) overrides the settings."""
    ini = ROOT / "alembic.ini"
    cfg = Config(str(ini)) if ini.exists() else Config()
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    if url is not None:
        cfg.attributes["url"] = url
    return cfg


def upgrade(url: str | None = None, revision: str = "head") -> None:
    """``alembic upgrade head``; running it twice changes nothing."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | None = None, revision: str = "base") -> None:
    """``alembic downgrade``."""
    command.downgrade(alembic_config(url), revision)


def current(url: str | None = None) -> None:
    """Print the current revision."""
    command.current(alembic_config(url))
