"""Library or user code, by where a module lives (docs/tags.md).

A config entry's module is ``library`` when its top-level package is found, without
importing it, under a library location of the Python that runs ``opguard``:
site-packages or dist-packages (``site.getsitepackages()``, the user site, the
``sysconfig`` ``purelib``/``platlib`` paths, any ``sys.path`` entry so named) or the
standard library (``sysconfig`` ``stdlib``/``platstdlib``, ``sys.stdlib_module_names``,
built-in modules). Anything else, the traced program's own files included, is
``user``.

Overrides, applied first: :data:`LIBRARY_PACKAGES` (always ``library``, so configs
generated where torch or transformers are not installed still tag them), and the
comma-separated ``$OPGUARD_LIBRARY_PACKAGES`` / ``$OPGUARD_USER_PACKAGES``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import os
import site
import sys
import sysconfig

#: Top-level packages tagged ``library`` wherever they are installed (an override).
LIBRARY_PACKAGES = frozenset(
    {"torch", "transformers", "accelerate", "deepspeed", "apex", "triton", "numpy", "opguard_core"}
)


def _env_set(name: str) -> frozenset[str]:
    return frozenset(p.strip() for p in os.environ.get(name, "").split(",") if p.strip())


@functools.lru_cache(maxsize=1)
def library_roots() -> tuple[str, ...]:
    """Directories whose code is library code (site-packages and the standard library)."""
    candidates: list[str] = []
    with contextlib.suppress(AttributeError):
        candidates.extend(site.getsitepackages())
    user_site = getattr(site, "getusersitepackages", lambda: None)()
    if isinstance(user_site, str):
        candidates.append(user_site)
    candidates.extend(
        p for p in sys.path if p.rstrip(os.sep).endswith(("site-packages", "dist-packages"))
    )
    paths = sysconfig.get_paths()
    keys = ("purelib", "platlib", "stdlib", "platstdlib")
    candidates.extend(paths[k] for k in keys if k in paths)
    roots = {os.path.normcase(os.path.realpath(c)).rstrip(os.sep) + os.sep for c in candidates if c}
    return tuple(sorted(roots))


def is_library_path(path: str) -> bool:
    """Is ``path`` under site-packages, dist-packages or the standard library?"""
    absolute = os.path.normcase(os.path.realpath(path))
    return any(absolute.startswith(root) for root in library_roots())


@functools.lru_cache(maxsize=4096)
def _located_in_library(top: str) -> bool:
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return True
    try:
        spec = importlib.machinery.PathFinder.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    locations = list(spec.submodule_search_locations or [])
    if spec.origin and spec.origin not in {"built-in", "frozen"}:
        locations.append(spec.origin)
    return bool(locations) and all(is_library_path(location) for location in locations)


def is_library_module(module: str) -> bool:
    """Is the module (``pkg.sub``) library code? See the module docstring for the rule."""
    top = module.split(".", 1)[0]
    if not top:
        return False
    if top in _env_set("OPGUARD_USER_PACKAGES"):
        return False
    if top in LIBRARY_PACKAGES or top in _env_set("OPGUARD_LIBRARY_PACKAGES"):
        return True
    return _located_in_library(top)
