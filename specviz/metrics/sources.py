"""Other tools' output as text: a file or the text itself, and the numbers their logs print.

Every reader of :mod:`specviz.metrics.external` takes a path or the file's text;
:func:`read_source` tells them apart. :data:`LOG_NUMBER` is the regular expression (one
group) of a number as the serving engines print it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["LOG_NUMBER", "read_source"]

#: a printed number (``nan`` included), as one regular-expression group
LOG_NUMBER = r"(nan|-?\d+(?:\.\d+)?)"


def read_source(source: str | os.PathLike, name: str | None) -> tuple[str, str]:
    """``(text, name)`` of a path or of literal text.

    A path-like is read; a string is read as a file when it is one short line naming an
    existing file, and is the text itself otherwise. ``name`` (default: the path, or
    ``"<text>"``) is what error messages call the input.

    Raises:
        TypeError: neither a path nor a string.
        FileNotFoundError: a one-line string with a results or log file's suffix that
            names no file.
    """
    if isinstance(source, os.PathLike):
        path = Path(source)
        return path.read_text(encoding="utf-8", errors="replace"), name or str(path)
    if not isinstance(source, str):
        raise TypeError(f"expected a path or the text itself, got {type(source).__name__}")
    if "\n" not in source and len(source) < 4096:
        path = Path(source).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8", errors="replace"), name or str(path)
        if path.suffix in (".jsonl", ".json", ".log", ".txt", ".out", ".err"):
            raise FileNotFoundError(f"no such file: {source}")
    return source, name or "<text>"
