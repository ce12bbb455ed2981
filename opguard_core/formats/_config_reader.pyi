"""Stub of the C extension ``opguard_core.formats._config_reader`` (``_config_reader.c``).

Loaded by :mod:`opguard_core.formats.config_reader` through
:func:`opguard_core.native.load_native`; ``py_read_fast`` there is the Python reference
(``read_strict`` there documents what the strict read adds).
"""

from ruamel.yaml.comments import CommentedMap, CommentedSeq, Format

def read_fast(
    text: str,
    map_type: type[CommentedMap],
    seq_type: type[CommentedSeq],
    format_type: type[Format],
    max_level: int,
    max_int_chars: int,
    /,
) -> CommentedMap | None: ...
def read_strict(
    text: str,
    map_type: type[CommentedMap],
    seq_type: type[CommentedSeq],
    format_type: type[Format],
    max_level: int,
    max_int_chars: int,
    /,
) -> tuple[CommentedMap, dict[str, str], dict[str, str], list[tuple[float, str, bool]]] | None: ...
