"""Readers of other input formats (the ``opguard_read_trace`` hook): torch.profiler's
Kineto traces (:mod:`opguard_plugins.readers.kineto`)."""
