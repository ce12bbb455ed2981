"""What the run and the config commands do to configs and traces: the filter chain and
merge fold, and ``--focus``/``--ignore`` selection."""
