"""The ``drop_small`` filter: drop entries that ran too rarely to be worth guarding.

Settings, from the environment (a filter receives only the config and the run's
options, so a third-party filter reads its own settings where it likes):

* ``OPGUARD_EXAMPLE_MIN_COUNT`` (default 10): drop entries whose ``count`` is
  below this;
* ``OPGUARD_EXAMPLE_DROP`` (default unset): a Python regular expression; also drop
  entries whose ``target`` it matches whole.

The filter edits ``config["entries"]`` in place and returns None ("keep the config
as it is now"); returning the config would do the same.
"""

from __future__ import annotations

import os
import re

from opguard_core import hookimpl
from opguard_core.errors import OpGuardError
from ruamel.yaml.comments import CommentedMap

MIN_COUNT_ENV = "OPGUARD_EXAMPLE_MIN_COUNT"
DROP_ENV = "OPGUARD_EXAMPLE_DROP"
DEFAULT_MIN_COUNT = 10


def min_count() -> int:
    """The threshold from ``$OPGUARD_EXAMPLE_MIN_COUNT`` (default 10)."""
    raw = os.environ.get(MIN_COUNT_ENV, "").strip()
    if not raw:
        return DEFAULT_MIN_COUNT
    try:
        value = int(raw)
    except ValueError:
        raise OpGuardError(f"${MIN_COUNT_ENV}={raw!r}: expected an integer") from None
    if value < 0:
        raise OpGuardError(f"${MIN_COUNT_ENV}={raw!r}: expected an integer >= 0")
    return value


def drop_pattern() -> re.Pattern[str] | None:
    """The pattern from ``$OPGUARD_EXAMPLE_DROP``, or None when unset."""
    raw = os.environ.get(DROP_ENV, "")
    if not raw:
        return None
    try:
        return re.compile(raw)
    except re.error as exc:
        raise OpGuardError(f"${DROP_ENV}={raw!r}: {exc}") from None


def keep(entry: dict[str, object], floor: int, pattern: re.Pattern[str] | None) -> bool:
    """Whether ``entry`` survives: ran at least ``floor`` times, target not matched."""
    count = entry.get("count", 0)
    if not isinstance(count, int) or count < floor:
        return False
    return pattern is None or pattern.fullmatch(str(entry["target"])) is None


@hookimpl
def opguard_filter(config: CommentedMap) -> None:
    # Only the arguments a hook names are passed: this filter does not need `options`.
    floor, pattern = min_count(), drop_pattern()
    entries = config["entries"]
    entries[:] = [entry for entry in entries if keep(entry, floor, pattern)]
