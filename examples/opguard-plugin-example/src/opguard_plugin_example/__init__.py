"""An example OpGuard plugin package.

Two plugins, each its own entry point in the ``opguard`` group:

* ``drop_small`` (:mod:`opguard_plugin_example.drop_small`): a filter that drops
  rarely-run entries and, optionally, entries whose target matches a pattern;
* ``shallow`` (:mod:`opguard_plugin_example.shallow`): a compressor that folds
  everything below a fixed depth of the call tree into its ancestor at that depth.
"""

__version__ = "0.1.0"
