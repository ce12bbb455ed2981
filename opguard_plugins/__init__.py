"""Built-in OpGuard plugins: one module per stage of ``opguard run``."""
