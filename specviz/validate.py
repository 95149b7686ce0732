"""Argument checks shared by every public function: one wording for one kind of mistake.

Each check returns the value it accepted, so it can sit in an assignment, and raises
``ValueError`` (or the error class given) naming the argument, what is allowed and what
was passed. ``bool`` is refused where an int is expected, although Python counts it as one.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

__all__ = ["check_int", "check_ints", "check_choice"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int = 1, maximum: int | None = None, *,
              error: type[Exception] = ValueError, note: str = "",
              type_error: type[Exception] | None = None) -> int:
    """``value`` if it is an int in ``[minimum, maximum]``; otherwise raise ``error``.

    Args:
        name: the argument's name, as the caller knows it.
        value: what was passed.
        minimum, maximum: the allowed range (``maximum`` None = unbounded).
        error: the exception class to raise (a ``ValueError`` subclass of the caller's).
        note: words added after the rule, e.g. ``"(prompts per run)"``.
        type_error: raise this instead (e.g. ``TypeError``) when ``value`` is not an int at all.
    """
    if type_error is not None and not _is_int(value):
        raise type_error(f"{name} must be an int, got {value!r}")
    if _is_int(value) and value >= minimum and (maximum is None or value <= maximum):
        return value
    rule = f"an int >= {minimum}" if maximum is None else f"an int in [{minimum}, {maximum}]"
    extra = f" {note}" if note else ""
    raise error(f"{name} must be {rule}{extra}, got {value!r}")


def check_ints(name: str, values: Iterable[Any], minimum: int = 1, *, allow_empty: bool = False) -> list[int]:
    """Every entry of ``values`` as an int ``>= minimum``; an empty list is refused unless allowed."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a list of ints >= {minimum}, got {values!r}")
    out = list(values)
    if not out and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    for v in out:
        if not (_is_int(v) and v >= minimum):
            raise ValueError(f"every entry of {name} must be an int >= {minimum}, got {v!r}")
    return out


def check_choice(name: str, value: Any, choices: Sequence[Any], *, error: type[Exception] = ValueError) -> Any:
    """``value`` if it is one of ``choices``; otherwise raise ``error`` listing them."""
    if value in choices:
        return value
    raise error(f"{name} must be one of {tuple(choices)}, got {value!r}")
