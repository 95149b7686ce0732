"""The shipped prompt set and the Spec-Bench-format loader."""

import json
from collections import Counter
from pathlib import Path

import pytest

from specviz.data.prompts import (
    CATEGORIES,
    DEFAULT_PROMPTS_PATH,
    Prompt,
    PromptFileError,
    load_prompts,
)


def write_jsonl(path: Path, records: list) -> Path:
    """Write records (dicts, or raw strings taken as lines) to a JSON Lines file."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def rec(qid: int, category: str = "code", *turns: str) -> dict:
    return {"question_id": qid, "category": category, "turns": list(turns or ("hi",))}


# ---------------------------------------------------------------- the shipped file


def test_shipped_file_loads_with_all_categories(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the default path must not depend on the cwd
    prompts = load_prompts()
    assert DEFAULT_PROMPTS_PATH == Path(__file__).resolve().parents[1] / "data" / "prompts.jsonl"
    assert prompts == load_prompts(DEFAULT_PROMPTS_PATH)
    counts = Counter(p.category for p in prompts)
    assert set(counts) == set(CATEGORIES)
    assert all(counts[c] >= 8 for c in CATEGORIES), counts
    ids = [p.question_id for p in prompts]
    assert len(ids) == len(set(ids))
    assert sorted(ids) == list(range(1, len(ids) + 1))
    # categories appear in CATEGORIES order in the file
    assert list(dict.fromkeys(p.category for p in prompts)) == list(CATEGORIES)


def test_shipped_prompts_are_reasonable():
    prompts = load_prompts()
    for p in prompts:
        assert isinstance(p, Prompt) and isinstance(p.turns, tuple)
        assert 1 <= len(p.turns) <= 2
        assert p.text == p.turns[0]
        assert sum(len(t.split()) for t in p.turns) <= 300, p.question_id
    assert sum(len(p.turns) == 1 for p in prompts) > len(prompts) // 2
    for p in prompts:
        if p.category == "rag":
            assert p.text.startswith("Context:") and "Question:" in p.text


def test_shipped_file_is_spec_bench_format():
    for line in DEFAULT_PROMPTS_PATH.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        assert set(record) == {"question_id", "category", "turns"}
        assert isinstance(record["question_id"], int)
        assert all(isinstance(t, str) and t for t in record["turns"])


# ---------------------------------------------------------------- limit / categories


def test_limit_one_per_category():
    prompts = load_prompts(limit=7)
    assert [p.category for p in prompts] == list(CATEGORIES)
    everything = load_prompts()
    firsts = [next(p for p in everything if p.category == c) for c in CATEGORIES]
    assert prompts == firsts


def test_limit_round_robin_is_deterministic_prefix():
    p3, p10, p14 = (load_prompts(limit=n) for n in (3, 10, 14))
    assert [p.category for p in p3] == list(CATEGORIES[:3])
    assert p10 == p14[:10]
    assert Counter(p.category for p in p14) == Counter({c: 2 for c in CATEGORIES})
    assert load_prompts(limit=10) == p10
    assert len(load_prompts(limit=10_000)) == len(load_prompts())


def test_limit_round_robin_uneven_categories(tmp_path):
    f = write_jsonl(
        tmp_path / "q.jsonl",
        [rec(1, "a"), rec(2, "a"), rec(3, "a"), rec(4, "b"), rec(5, "c"), rec(6, "c")],
    )
    ids = [p.question_id for p in load_prompts(f, limit=6)]
    assert ids == [1, 4, 5, 2, 6, 3]
    assert [p.question_id for p in load_prompts(f, limit=4)] == [1, 4, 5, 2]
    # without limit: file order
    assert [p.question_id for p in load_prompts(f)] == [1, 2, 3, 4, 5, 6]


def test_categories_filter():
    only = load_prompts(categories=["rag", "code"])
    assert {p.category for p in only} == {"rag", "code"}
    assert only == [p for p in load_prompts() if p.category in ("rag", "code")]
    assert [p.category for p in load_prompts(categories=["rag", "code"], limit=2)] == [
        "code",
        "rag",
    ]
    assert load_prompts(categories="qa") == load_prompts(categories=["qa"])


def test_unknown_category_lists_known_ones():
    with pytest.raises(ValueError, match="unknown category 'poetry'") as info:
        load_prompts(categories=["code", "poetry"])
    for c in CATEGORIES:
        assert c in str(info.value)
    with pytest.raises(ValueError, match="at least one"):
        load_prompts(categories=[])


@pytest.mark.parametrize("limit", [0, -3])
def test_limit_below_one(limit):
    with pytest.raises(ValueError, match="limit must be an int >= 1"):
        load_prompts(limit=limit)


@pytest.mark.parametrize("limit", [1.5, "3", True])
def test_limit_wrong_type(limit):
    with pytest.raises(TypeError, match="limit"):
        load_prompts(limit=limit)


# ---------------------------------------------------------------- Spec-Bench files


def test_extra_keys_ignored_and_free_form_categories(tmp_path):
    f = write_jsonl(
        tmp_path / "question.jsonl",
        [
            {"question_id": 81, "category": "writing", "turns": ["a", "b"], "reference": ["x"]},
            {"question_id": 7, "category": "mt_bench", "turns": ["c"], "extra": {"k": 1}},
            "",
            {"question_id": 3, "category": "retrieval", "turns": ["d"], "reference": None},
        ],
    )
    prompts = load_prompts(str(f))
    assert prompts == [
        Prompt(81, "writing", ("a", "b")),
        Prompt(7, "mt_bench", ("c",)),
        Prompt(3, "retrieval", ("d",)),
    ]
    assert prompts[0].text == "a"
    assert [p.category for p in load_prompts(f, limit=3)] == ["writing", "mt_bench", "retrieval"]


def test_byte_order_mark_tolerated(tmp_path):
    f = tmp_path / "bom.jsonl"
    f.write_text("\ufeff" + json.dumps(rec(1)) + "\n", encoding="utf-8")
    assert load_prompts(f) == [Prompt(1, "code", ("hi",))]


# ---------------------------------------------------------------- errors


def test_bad_json_names_file_and_line(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", [rec(1), rec(2), '{"question_id": 3, "category": '])
    with pytest.raises(PromptFileError, match=r"line 3: invalid JSON") as info:
        load_prompts(f)
    assert str(f) in str(info.value)
    assert info.value.line == 3 and info.value.path == f
    assert isinstance(info.value, ValueError)


def test_line_numbers_count_blank_lines(tmp_path):
    f = write_jsonl(tmp_path / "blank.jsonl", [rec(1), "", "   ", "not json"])
    with pytest.raises(PromptFileError, match=r"line 4: invalid JSON"):
        load_prompts(f)


def test_missing_turns(tmp_path):
    f = write_jsonl(tmp_path / "q.jsonl", [rec(1), {"question_id": 2, "category": "qa"}])
    with pytest.raises(PromptFileError, match=r"line 2: missing key\(s\) 'turns'"):
        load_prompts(f)


def test_duplicate_ids(tmp_path):
    f = write_jsonl(tmp_path / "q.jsonl", [rec(1), rec(2), rec(1, "qa")])
    with pytest.raises(PromptFileError, match=r"line 3: duplicate question_id 1 \(first used on line 1\)"):
        load_prompts(f)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    f = tmp_path / "empty.jsonl"
    f.write_text(content, encoding="utf-8")
    with pytest.raises(PromptFileError, match="contains no prompts") as info:
        load_prompts(f)
    assert str(f) in str(info.value) and info.value.line is None


@pytest.mark.parametrize(
    "record, match",
    [
        ([1, 2], "expected a JSON object, got list"),
        ({"question_id": "1", "category": "qa", "turns": ["x"]}, "'question_id' must be an integer"),
        ({"question_id": True, "category": "qa", "turns": ["x"]}, "'question_id' must be an integer"),
        ({"question_id": 1.0, "category": "qa", "turns": ["x"]}, "'question_id' must be an integer"),
        ({"question_id": 1, "category": 5, "turns": ["x"]}, "'category' must be a non-empty string"),
        ({"question_id": 1, "category": "", "turns": ["x"]}, "'category' must be a non-empty string"),
        ({"question_id": 1, "category": "qa", "turns": "x"}, "'turns' must be a list"),
        ({"question_id": 1, "category": "qa", "turns": []}, "'turns' is empty"),
        ({"question_id": 1, "category": "qa", "turns": ["x", 2]}, r"'turns'\[1\] must be a string"),
        ({"question_id": 1, "category": "qa", "turns": ["  "]}, r"'turns'\[0\] is an empty string"),
        ({"category": "qa"}, "missing key\\(s\\) 'question_id', 'turns'"),
    ],
)
def test_wrong_types(tmp_path, record, match):
    f = write_jsonl(tmp_path / "q.jsonl", [rec(10), record])
    with pytest.raises(PromptFileError, match="line 2: " + match):
        load_prompts(f)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(tmp_path / "nope.jsonl")


def test_prompt_is_frozen_and_validated():
    p = Prompt(1, "qa", ("one", "two"))
    assert p.text == "one"
    with pytest.raises(AttributeError):
        p.category = "code"  # type: ignore[misc]
    with pytest.raises(ValueError):
        Prompt(1, "qa", ())
    with pytest.raises(TypeError):
        Prompt(1, "qa", ["x"])  # type: ignore[arg-type]
