"""Built-in plugin: ``opguard guard`` (see guard_runtime.py)."""
