"""Built-in OpGuard plugins, each registered under the ``opguard`` entry-point group.

* :mod:`~opguard_plugins.stages`: the stages of ``opguard run``, one module each;
* :mod:`~opguard_plugins.record`: ``opguard trace`` and the tracer;
* :mod:`~opguard_plugins.enforce`: ``opguard check`` and ``opguard guard``;
* :mod:`~opguard_plugins.view`: exports, ``report.html`` and the commands on configs.

``opguard_plugins.tracer`` and ``opguard_plugins.guard_runtime`` are the public import
paths of ``trace_callsites`` and ``guarded``.
"""
