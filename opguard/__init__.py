"""Only so that ``python -m opguard`` runs the ``opguard`` command.

OpGuard's code lives in ``opguard_core`` and ``opguard_plugins``; this package holds
nothing else (docs/architecture.md, "python -m opguard").
"""
