"""One module per document: callsite traces, call trees, configs, divergence and check
reports (docs/formats.md names the module of each), and the helpers they share."""

#: how the name of an instrumentation config (YAML) ends
CONFIG_SUFFIXES = (".yaml", ".yml")


def names_a_config(name: str) -> bool:
    """Whether a file name (or pattern) is an instrumentation config's: what the
    commands that read traces refuse, with a pointer to the config commands."""
    return name.lower().endswith(CONFIG_SUFFIXES)


__all__ = ["CONFIG_SUFFIXES", "names_a_config"]
