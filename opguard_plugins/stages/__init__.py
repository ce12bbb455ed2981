"""The stages of ``opguard run``: one module per stage (discover, combine, divergence,
compress, generate, compare, merge, the basic filter), the Dask executor, and what they share."""
