"""The public import path of the tracer, kept from before the sub-packages.

``from opguard_plugins.tracer import trace_callsites`` keeps working; the tracer lives
in :mod:`opguard_plugins.record.tracer`.
"""

from opguard_plugins.record.tracer import CallsiteTracer, trace_callsites

__all__ = ["CallsiteTracer", "trace_callsites"]
