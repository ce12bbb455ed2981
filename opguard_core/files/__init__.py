"""Files handled safely: atomic artifact writes, output locations checked up front, and
what a path names asked without raising (:mod:`~opguard_core.files.lookup`)."""
