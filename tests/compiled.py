"""The C extensions, for the tests that hold each to its Python reference.

:func:`compiled` imports an extension directly, whatever ``OPGUARD_PURE_PYTHON``
says (those tests compare both paths side by side, in one process), and answers None
where it was not built: the tests marked :func:`needs` then skip. Under
``OPGUARD_REQUIRE_NATIVE=1`` (``.ci/run`` sets it where a compiler exists) a missing
build raises instead, so those tests fail rather than skip.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

from opguard_core.native import REQUIRE_NATIVE_ENV

#: every C extension and the module that holds (or loads) its Python reference
EXTENSIONS = {
    "opguard_core.combine._scan": "opguard_core.combine.stack_table",
    "opguard_plugins.stages._runs": "opguard_plugins.stages.sorted_runs",
    "opguard_plugins.record._recorder": "opguard_plugins.record.tracer",
    "opguard_core.formats._config_reader": "opguard_core.formats.config_reader",
}


def required() -> bool:
    """Whether a missing build is a failure (``OPGUARD_REQUIRE_NATIVE``)."""
    return os.environ.get(REQUIRE_NATIVE_ENV, "") not in ("", "0")


def compiled(name: str) -> ModuleType | None:
    """The built extension ``name``, or None where it was not built (a failure
    instead under ``OPGUARD_REQUIRE_NATIVE``)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if required():
            raise
        return None


def needs(module: ModuleType | None) -> pytest.MarkDecorator:
    """Skip where ``module`` (from :func:`compiled`) was not built."""
    return pytest.mark.skipif(module is None, reason="the C extension was not built")
