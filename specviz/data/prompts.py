"""The prompt set: Spec-Bench-format questions, loaded and validated.

Prompts live in a JSON Lines file with one object per line, in Spec-Bench's question
format::

    {"question_id": 1, "category": "code", "turns": ["Write a Python function ..."]}

``turns`` holds one or more user turns (most prompts have one). Unknown keys, such as
Spec-Bench's ``"reference"``, are ignored, and categories are free-form strings, so any
Spec-Bench question file loads. Blank lines are skipped.

The shipped set, ``data/prompts.jsonl`` at the repository root, covers the seven
:data:`CATEGORIES` with 8-9 original prompts each. ``load_prompts(limit=7)`` gives one
prompt per category: ``limit`` picks prompts round-robin over categories.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from specviz.locations import DATA_DIR
from specviz.validate import check_int

__all__ = [
    "CATEGORIES",
    "DEFAULT_PROMPTS_PATH",
    "Prompt",
    "PromptFileError",
    "load_prompts",
]

#: The categories of the shipped prompt set, in the order they appear in the file.
CATEGORIES: tuple[str, ...] = (
    "code",
    "translation",
    "summarization",
    "qa",
    "math_reasoning",
    "rag",
    "writing",
)

#: ``<repo root>/data/prompts.jsonl``, located from this file, not the working directory.
DEFAULT_PROMPTS_PATH: Path = DATA_DIR / "prompts.jsonl"

_REQUIRED_KEYS: tuple[str, ...] = ("question_id", "category", "turns")


class PromptFileError(ValueError):
    """A prompt file that cannot be read as Spec-Bench-format questions.

    The message starts with ``<path>, line <n>:`` when a specific line is at fault.

    Attributes:
        path: The file being loaded.
        line: The 1-based line number at fault, or ``None`` for file-level problems.
    """

    def __init__(self, path: Path, line: int | None, message: str) -> None:
        self.path = path
        self.line = line
        where = f"{path}, line {line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class Prompt:
    """One question of the prompt set.

    Attributes:
        question_id: Unique integer id within its file.
        category: Category name, e.g. ``"code"`` (free-form in Spec-Bench files).
        turns: The user turns, in order; at least one, each a non-empty string.
    """

    question_id: int
    category: str
    turns: tuple[str, ...]

    def __post_init__(self) -> None:
        if isinstance(self.question_id, bool) or not isinstance(self.question_id, int):
            raise TypeError(f"question_id must be an int, got {self.question_id!r}")
        if not isinstance(self.category, str) or not self.category:
            raise TypeError(f"category must be a non-empty str, got {self.category!r}")
        if not isinstance(self.turns, tuple):
            raise TypeError(f"turns must be a tuple of str, got {type(self.turns).__name__}")
        if not self.turns:
            raise ValueError("turns must hold at least one turn")
        for i, turn in enumerate(self.turns):
            if not isinstance(turn, str) or not turn.strip():
                raise ValueError(f"turns[{i}] must be a non-empty str, got {turn!r}")

    @property
    def text(self) -> str:
        """The first user turn (the whole prompt for single-turn questions)."""
        return self.turns[0]


def _parse_line(path: Path, lineno: int, line: str) -> Prompt:
    """One JSON line -> :class:`Prompt`, or :class:`PromptFileError` naming the line."""
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptFileError(
            path, lineno, f"invalid JSON: {exc.msg} (column {exc.colno})"
        ) from None
    if not isinstance(record, dict):
        raise PromptFileError(
            path, lineno, f"expected a JSON object, got {type(record).__name__}"
        )
    missing = [key for key in _REQUIRED_KEYS if key not in record]
    if missing:
        raise PromptFileError(
            path, lineno, f"missing key(s) {', '.join(map(repr, missing))}"
        )

    qid = record["question_id"]
    if isinstance(qid, bool) or not isinstance(qid, int):
        raise PromptFileError(
            path, lineno, f"'question_id' must be an integer, got {qid!r}"
        )
    category = record["category"]
    if not isinstance(category, str) or not category.strip():
        raise PromptFileError(
            path, lineno, f"'category' must be a non-empty string, got {category!r}"
        )
    turns = record["turns"]
    if not isinstance(turns, list):
        raise PromptFileError(
            path, lineno, f"'turns' must be a list of strings, got {type(turns).__name__}"
        )
    if not turns:
        raise PromptFileError(path, lineno, "'turns' is empty; at least one turn is needed")
    for i, turn in enumerate(turns):
        if not isinstance(turn, str):
            raise PromptFileError(
                path, lineno, f"'turns'[{i}] must be a string, got {type(turn).__name__}"
            )
        if not turn.strip():
            raise PromptFileError(path, lineno, f"'turns'[{i}] is an empty string")
    return Prompt(question_id=qid, category=category, turns=tuple(turns))


def _read_file(path: Path) -> list[Prompt]:
    """Every prompt of ``path`` in file order, validated (ids unique, file not empty)."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    prompts: list[Prompt] = []
    first_line: dict[int, int] = {}
    # utf-8-sig: tolerate a byte-order mark at the start of the file.
    with path.open(encoding="utf-8-sig") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            prompt = _parse_line(path, lineno, line)
            if prompt.question_id in first_line:
                raise PromptFileError(
                    path,
                    lineno,
                    f"duplicate question_id {prompt.question_id} "
                    f"(first used on line {first_line[prompt.question_id]})",
                )
            first_line[prompt.question_id] = lineno
            prompts.append(prompt)
    if not prompts:
        raise PromptFileError(path, None, "the file contains no prompts")
    return prompts


def _round_robin(prompts: list[Prompt], limit: int) -> list[Prompt]:
    """The first ``limit`` prompts taking one per category in turn.

    Categories are visited in order of first appearance in the file, and prompts within
    a category keep their file order, so the result is deterministic and each shorter
    limit is a prefix of a longer one.
    """
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    queues = list(by_category.values())
    picked: list[Prompt] = []
    depth = 0
    while len(picked) < limit:
        round_ = [queue[depth] for queue in queues if depth < len(queue)]
        if not round_:
            break
        picked.extend(round_[: limit - len(picked)])
        depth += 1
    return picked


def load_prompts(
    path: str | Path | None = None,
    *,
    limit: int | None = None,
    categories: Sequence[str] | None = None,
) -> list[Prompt]:
    """Load and validate a Spec-Bench-format prompt file.

    Args:
        path: JSON Lines file; ``None`` means the shipped set,
            :data:`DEFAULT_PROMPTS_PATH` (resolved from this module, not the working
            directory).
        limit: Keep at most this many prompts, picked round-robin over categories: the
            first prompt of each category, then the second of each, and so on, with
            categories in order of first appearance. The result comes back in that
            round-robin order, so ``limit=7`` on the shipped set gives one prompt per
            category. ``None`` keeps every prompt, in file order.
        categories: Keep only these categories (applied before ``limit``). A single
            string is treated as one category name.

    Returns:
        The selected prompts.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        PromptFileError: (a ``ValueError``) a line is not valid JSON, is not an object,
            lacks ``question_id``/``category``/``turns``, has a value of the wrong type
            or empty turns, repeats a ``question_id``, or the file has no prompts.
            The message names the file and the line number.
        ValueError: ``limit`` < 1, ``categories`` is empty, or names a category that is
            not in the file (the message lists the known ones).
        TypeError: ``limit`` is not an int.
    """
    if limit is not None:
        check_int("limit", limit, type_error=TypeError, note="or None")

    file = DEFAULT_PROMPTS_PATH if path is None else Path(path)
    prompts = _read_file(file)

    if categories is not None:
        wanted = [categories] if isinstance(categories, str) else list(categories)
        if not wanted:
            raise ValueError("categories must name at least one category (or be None)")
        known = list(dict.fromkeys(p.category for p in prompts))
        unknown = [c for c in wanted if c not in known]
        if unknown:
            raise ValueError(
                f"unknown categor{'y' if len(unknown) == 1 else 'ies'} "
                f"{', '.join(map(repr, unknown))} for {file}; "
                f"known categories: {', '.join(known)}"
            )
        keep = set(wanted)
        prompts = [p for p in prompts if p.category in keep]

    if limit is not None:
        prompts = _round_robin(prompts, limit)
    return prompts
