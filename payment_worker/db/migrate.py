"""Running the alembic migrations from code (``payment-worker db upgrade``).

The alembic environment ships inside the package (``payment_worker/migrations``), so an
installed wheel migrates from any working directory; the repository's ``alembic.ini`` points
at the same folder for developers who run ``alembic`` by hand.
"""

from __future__ import annotations

from importlib import resources

from alembic import command
from alembic.config import Config


def alembic_config(url: str | None = None) -> Config:
    """The alembic config of the packaged migrations for the database at ``url`` (SQLAlchemy
    form); without one, env.py reads the settings."""
    cfg = Config()
    # the folder inside the installed package, wherever the command runs from
    cfg.set_main_option("script_location", str(resources.files("payment_worker") / "migrations"))
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
