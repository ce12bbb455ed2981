"""The plugin machinery: the manager (entry-point loading, blocking, listing) and the
names the CLI needs before any plugin loads."""
