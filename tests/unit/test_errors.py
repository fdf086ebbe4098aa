"""Every exception class of the package derives from PaymentWorkerError (SettingsError aside)."""

from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import payment_worker
from payment_worker.domain.batch_schema import InvalidBatch, RefusedJSON
from payment_worker.errors import PaymentWorkerError
from payment_worker.settings import SettingsError

PACKAGE = Path(payment_worker.__file__).parent
# a SystemExit on purpose: a bad setting ends any process with exit code 2, and no
# ``except Exception`` can swallow it (see payment_worker/errors.py)
EXEMPT = {"payment_worker.settings.SettingsError"}
_BUILTIN_ERRORS = {
    name
    for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, BaseException)
}


def _base_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _exception_classes() -> dict[str, str]:
    """``qualified name -> module`` of the package's exception classes, found in the source
    (importing every module would run import-time code such as celery_config's)."""
    classes: list[tuple[str, str, set[str]]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.append((module, node.name, {_base_name(b) for b in node.bases}))
    known = set(_BUILTIN_ERRORS)
    found: dict[str, str] = {}
    grew = True
    while grew:  # a class whose base is an exception class is one too
        grew = False
        for module, name, bases in classes:
            if bases & known and f"{module}.{name}" not in found:
                found[f"{module}.{name}"] = module
                known.add(name)
                grew = True
    return found


def test_every_error_class_derives_from_the_base() -> None:
    found = _exception_classes()
    assert "payment_worker.domain.batch_schema.InvalidBatch" in found
    outside = []
    for qualified, module in found.items():
        cls = getattr(importlib.import_module(module), qualified.rsplit(".", 1)[1])
        if qualified not in EXEMPT and not issubclass(cls, PaymentWorkerError):
            outside.append(qualified)
    assert outside == []
    assert issubclass(SettingsError, SystemExit)


def test_value_errors_stay_value_errors() -> None:
    assert issubclass(InvalidBatch, ValueError) and issubclass(RefusedJSON, ValueError)
    assert InvalidBatch([{"path": "$", "message": "x"}]).errors == [{"path": "$", "message": "x"}]
