"""One module per document: callsite traces, call trees, configs, divergence and check
reports (docs/formats.md names the module of each), and the helpers they share."""

#: how the name of an instrumentation config (YAML) ends: what the commands that read
#: traces refuse with a pointer to the config commands
CONFIG_SUFFIXES = (".yaml", ".yml")

__all__ = ["CONFIG_SUFFIXES"]
