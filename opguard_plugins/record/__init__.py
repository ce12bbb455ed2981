"""Recording: the ``opguard trace`` command, its bootstrap, and the tracer's two
backends (``modes`` with its C recorder, ``profiler``)."""
