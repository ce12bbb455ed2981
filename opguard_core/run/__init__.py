"""The run machinery of ``opguard run``: the runner, its forked helpers, the run
directory (artifacts, stale runs), warnings and the summary."""
