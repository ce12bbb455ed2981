"""``python -m opguard``: the ``opguard`` console script (``opguard_core.cli.main``)."""

from opguard_core.cli import main

if __name__ == "__main__":
    main()
