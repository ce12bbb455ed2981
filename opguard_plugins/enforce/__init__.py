"""Enforcing a config: ``opguard check`` and its rules (offline), ``opguard guard`` and
the runtime guard (at run time)."""
