"""The public import path of the runtime guard, kept from before the sub-packages.

``from opguard_plugins.guard_runtime import guarded`` keeps working; the guard lives in
:mod:`opguard_plugins.enforce.runtime`.
"""

from opguard_plugins.enforce.runtime import Guard, OpGuardViolation, guarded

__all__ = ["Guard", "OpGuardViolation", "guarded"]
