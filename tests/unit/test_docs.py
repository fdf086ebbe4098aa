"""docs/configuration.md documents every setting, with the default the code really uses."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from payment_worker.settings import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
# a table row: | `NAME` | type | default | meaning |
ROW = re.compile(r"^\|\s*`([A-Z][A-Z0-9_]*)`\s*\|([^|]*)\|([^|]*)\|", re.M)


def _rows() -> dict[str, tuple[str, str]]:
    text = DOC.read_text()
    # the test-only section documents variables the service itself never reads
    service_part = text.split("## Test-only variables")[0]
    return {
        name: (typ.strip(), default.strip()) for name, typ, default in ROW.findall(service_part)
    }


def _render(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, Path):
        return str(value) if value.is_absolute() else f"./{value}"
    return str(value)


def test_every_setting_is_documented() -> None:
    rows = _rows()
    missing = [name.upper() for name in Settings.model_fields if name.upper() not in rows]
    assert not missing, f"add these to docs/configuration.md: {missing}"


def test_no_documented_setting_is_stale() -> None:
    fields = {name.upper() for name in Settings.model_fields}
    assert set(_rows()) <= fields


def test_documented_defaults_match_the_code() -> None:
    rows = _rows()
    for name, field in Settings.model_fields.items():
        doc_default = rows[name.upper()][1].strip("`")
        default = field.get_default(call_default_factory=True)
        if default is None:
            # unset: the embedded server, or another variable's value (CELERY_BROKER_URL)
            assert doc_default == "unset" or doc_default in rows, name
        else:
            assert doc_default == _render(default), f"{name.upper()}: {doc_default!r}"


def test_exit_code_two_is_explained() -> None:
    text = DOC.read_text()
    assert "exit code 2" in text.lower() or "code **2**" in text
