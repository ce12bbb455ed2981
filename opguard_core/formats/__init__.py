"""One module per document: callsite traces, call trees, configs, divergence and check
reports (docs/formats.md names the module of each), and the helpers they share."""
