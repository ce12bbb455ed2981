"""The optional C extension; everything else is declared in pyproject.toml.

``opguard_plugins._recorder`` is the modes backend's per-operator hot path
(docs/tracing.md, "The recorder's fast path"). It is optional: without a C compiler
and Python's headers the install goes on, and the tracer runs its Python path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "opguard_plugins._recorder",
            sources=["opguard_plugins/_recorder.c"],
            optional=True,
        )
    ]
)
