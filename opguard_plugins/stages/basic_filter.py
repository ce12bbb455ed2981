"""Stage 7, the built-in basic filter (``opguard run --basic``).

Drops entries for common torch tensor utilities (as ``torch_api`` nodes or as
torch's own Python functions) and keeps only ``function`` and ``method`` entries.
The list lives in ``basic_filter.yaml`` beside this module; ``--basic-list FILE``
replaces it. The entries that stay still carry, inclusively, the ops of the
utilities they called.
"""

from __future__ import annotations

import dataclasses
import stat
from importlib import resources
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.error import YAMLError

from opguard_core import hookimpl
from opguard_core.configs.chain import settings_of
from opguard_core.errors import InputError
from opguard_core.formats.config import BoundedComposer, ConfigLimitError, max_config_bytes
from opguard_core.formats.trace import is_torch_module
from opguard_core.model import RunOptions


@dataclasses.dataclass(frozen=True)
class BasicList:
    utilities: frozenset[str]
    keep_kinds: frozenset[str]


def load_basic_list(path: Path | None = None) -> BasicList:
    """Read a basic-filter list (the bundled one when ``path`` is None)."""
    where: Path | str = path or "opguard_plugins/stages/basic_filter.yaml"
    try:
        if path is None:
            text = (
                resources.files("opguard_plugins.stages").joinpath("basic_filter.yaml").read_text()
            )
        else:
            info = path.stat()
            if not stat.S_ISREG(info.st_mode):  # a FIFO or a device would block
                raise InputError(where, "cannot read basic-filter list: not a regular file")
            if info.st_size > max_config_bytes():  # refused unread, as a config is
                raise InputError(where, "basic-filter list too large")
            text = path.read_text(encoding="utf-8")
        if len(text) > max_config_bytes():
            raise InputError(where, "basic-filter list too large")
        yaml = YAML(typ="safe", pure=True)
        yaml.Composer = BoundedComposer  # depth, aliases, integers: as for configs
        data = yaml.load(text)
    except OSError as exc:
        raise InputError(where, f"cannot read basic-filter list: {exc.strerror or exc}") from None
    except ConfigLimitError as exc:
        raise InputError(where, str(exc)) from None
    except (YAMLError, UnicodeDecodeError) as exc:
        raise InputError(where, f"malformed YAML: {' '.join(str(exc).split())}") from None
    except ValueError as exc:  # a value the constructor refuses
        raise InputError(where, f"unreadable value: {exc}") from None
    if not isinstance(data, dict):
        raise InputError(where, "basic-filter list must be a mapping with 'utilities'")
    utilities = data.get("utilities")
    kinds = data.get("keep_kinds", ["function", "method"])
    for name, value in (("utilities", utilities), ("keep_kinds", kinds)):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InputError(where, f"'{name}' must be a list of strings")
    return BasicList(frozenset(utilities), frozenset(kinds))  # type: ignore[arg-type]


def is_torch_utility(target: str, utilities: frozenset[str]) -> bool:
    module, _, qualname = target.partition(":")
    if not is_torch_module(module):
        return False
    return qualname.rsplit(".", 1)[-1] in utilities


def keep_entry(entry: dict[str, Any], rules: BasicList) -> bool:
    return entry.get("kind") in rules.keep_kinds and not is_torch_utility(
        str(entry["target"]), rules.utilities
    )


@hookimpl
def opguard_check_options(options: RunOptions) -> None:
    """A ``--basic-list`` that cannot be read or is malformed is refused before the run."""
    if options.basic and options.basic_list is not None:
        load_basic_list(options.basic_list)


@hookimpl(trylast=True)
def opguard_filter(config: CommentedMap, options: RunOptions) -> CommentedMap:
    rules = load_basic_list(options.basic_list)
    entries = config["entries"]
    entries[:] = [entry for entry in entries if keep_entry(entry, rules)]
    if options.basic_list is not None:  # check rebuilds the run with the same list
        settings_of(config)["basic_list"] = str(Path(options.basic_list).resolve())
    return config
