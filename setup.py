"""The optional C extensions; everything else is declared in pyproject.toml.

``opguard_plugins.record._recorder`` is the modes backend's per-operator hot path
(docs/tracing.md, "The recorder's fast path"); ``opguard_core.combine._scan`` is the combine's
(docs/performance.md, "Folding from the bytes"); ``opguard_plugins.stages._runs`` is
compress's ("Compiled per-site work"); ``opguard_core.formats._config_reader`` is the
config reader's ("Scale of the small things"). All are optional: without a C
compiler and Python's headers the install goes on, and Python paths run instead.
Each has a ``.pyi`` stub beside it; ``opguard_core.native.load_native`` loads them
(docs/architecture.md, "C extensions").
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "opguard_plugins.record._recorder",
            sources=["opguard_plugins/record/_recorder.c"],
            optional=True,
        ),
        Extension(
            "opguard_core.combine._scan",
            sources=["opguard_core/combine/_scan.c"],
            optional=True,
        ),
        Extension(
            "opguard_plugins.stages._runs",
            sources=["opguard_plugins/stages/_runs.c"],
            optional=True,
        ),
        Extension(
            "opguard_core.formats._config_reader",
            sources=["opguard_core/formats/_config_reader.c"],
            optional=True,
        ),
    ]
)
