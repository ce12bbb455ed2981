"""Looking at results: ``opguard export`` and its formats, ``report.html``, and the
commands on configs (compare, merge, filter, show)."""
