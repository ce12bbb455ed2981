"""The public import path of the tracer, kept from before the sub-packages.

``from opguard_plugins.tracer import trace_callsites`` keeps working; the tracer lives
in :mod:`opguard_plugins.record.tracer` and :mod:`opguard_plugins.record.backends`.
"""

from opguard_plugins.record.backends import trace_callsites
from opguard_plugins.record.tracer import CallsiteTracer

__all__ = ["CallsiteTracer", "trace_callsites"]
