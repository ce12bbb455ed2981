"""The optional C extensions: one loader, one switch to force the Python references.

Four hot paths have a C twin, built by ``setup.py`` where a compiler and Python's
headers exist (docs/architecture.md, "C extensions"); each is held to a Python
reference that stays the definition of what it does:

========================================  ==========================================
compiled module (stub beside it)          its Python reference
========================================  ==========================================
``opguard_core.combine._scan``            ``opguard_core.combine.stack_table`` and the
                                          accumulator's loops
``opguard_plugins.stages._runs``          ``opguard_plugins.stages.sorted_runs``
``opguard_plugins.record._recorder``      ``opguard_plugins.record.tracer``
``opguard_core.formats._config_reader``   ``opguard_core.formats.config_reader``
========================================  ==========================================

The module that owns a reference asks :func:`load_native` once, at import, and uses
the reference where it answers None. Two environment variables, read there:

- ``OPGUARD_PURE_PYTHON=1`` forces every reference (to compare, or to rule the C
  out while hunting a bug); outputs are byte-identical either way.
- ``OPGUARD_REQUIRE_NATIVE=1`` turns a module that was not built into an
  ``ImportError`` naming it, instead of a quiet fallback (CI sets it where a
  compiler exists, so a broken build fails the tests instead of skipping them).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

#: set (to anything but "" or "0"): every accelerated module runs its Python reference
PURE_PYTHON_ENV = "OPGUARD_PURE_PYTHON"
#: set: a compiled module that cannot be imported is an error, not a fallback
REQUIRE_NATIVE_ENV = "OPGUARD_REQUIRE_NATIVE"


def _switched_on(variable: str) -> bool:
    return os.environ.get(variable, "") not in ("", "0")


def pure_python() -> bool:
    """Whether ``OPGUARD_PURE_PYTHON`` forces the Python references."""
    return _switched_on(PURE_PYTHON_ENV)


def load_native(name: str) -> ModuleType | None:
    """The compiled module ``name``, or None where its Python reference must run:
    ``OPGUARD_PURE_PYTHON`` is set, or the module was not built.

    :raises ImportError: the module was not built (or does not load) and
        ``OPGUARD_REQUIRE_NATIVE`` is set; the message names the module.
    """
    if pure_python():
        return None
    try:
        return importlib.import_module(name)
    except ImportError as error:
        if _switched_on(REQUIRE_NATIVE_ENV):
            raise ImportError(
                f"the C extension {name} is not available ({error}); "
                f"{REQUIRE_NATIVE_ENV} is set, so its Python reference may not stand in: "
                "reinstall with a C compiler and Python's headers (pip install -e .)",
                name=name,
            ) from error
        return None


__all__ = ["PURE_PYTHON_ENV", "REQUIRE_NATIVE_ENV", "load_native", "pure_python"]
