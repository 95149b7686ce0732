"""The templates behind :func:`~specviz.heads.corpus.task_prompts`: prompts of the study's
task kinds (writing, questions, word problems, translation, summarisation, questions on
a context, code) with random slots - names, topics, languages, numbers - and prose
passages of the Python reference that ships with the standard library, never text of
the evaluation file.

* :data:`TASK_KINDS` - the kinds, the same as the shipped evaluation set's;
* the slot values of each kind, the word-problem generator and the prose passages
  (``pydoc_data.topics``, code and grammar blocks left out);
* the check of the kinds a caller asks for.
"""

from __future__ import annotations

import random
from typing import Sequence

__all__ = ["TASK_KINDS"]

#: the task kinds :func:`~specviz.heads.corpus.task_prompts` writes, the same kinds as the shipped evaluation set
TASK_KINDS: tuple[str, ...] = ("code", "math_reasoning", "qa", "rag", "summarization", "translation", "writing")

_PEOPLE = ("Mr. Okafor", "Ms. Lindqvist", "Dr. Romero", "my neighbour Sam", "the head of IT", "my team",
           "Professor Chen", "the hiring manager", "my sister Ana", "the building manager", "a new colleague",
           "the school principal", "our customers", "the city council", "my landlord, Mr. Duarte")
_WRITING_TOPICS = ("a delayed delivery of office chairs", "the noise from the flat upstairs",
                   "a request to work from home on Fridays", "the cancelled team offsite",
                   "a refund for a broken kettle", "the new recycling rules", "a thank-you for a job reference",
                   "moving the weekly meeting to Tuesday", "a leaking kitchen tap", "the results of the user survey",
                   "an invitation to a charity run", "a late invoice", "a change of address",
                   "feedback on a draft report", "a missing parcel", "the school trip next month",
                   "a request for a day of leave", "a broken street light", "the launch of a new product",
                   "a complaint about a hotel stay")
_WRITING_KINDS = ("an email", "a short letter", "a polite message", "a formal complaint", "a friendly note",
                  "an announcement")
_WRITING_ASKS = ("Keep it under 150 words.", "Be polite but firm.", "Use a warm, informal tone.",
                 "End with a clear request and a deadline.", "Use three short paragraphs.",
                 "Mention that I am available on weekday mornings.")
_FREEFORM = ("Write a short story about {thing} in about 150 words.", "Write a product description for {thing}.",
             "Write a four-line poem about {thing}.", "Write the opening paragraph of a blog post about {thing}.",
             "Write a short speech for a colleague's farewell party that mentions {thing}.")
_THINGS = ("a lighthouse keeper", "a reusable water bottle", "autumn in a small town", "a robot learning to cook",
           "a rainy train journey", "a lost umbrella", "a community garden", "a solar-powered lamp",
           "the first day at a new job", "an old bicycle", "a night market", "a noise-cancelling headset")

_WHY = ("does a straw look bent in a glass of water", "do leaves change colour in autumn", "does ice float on water",
        "do we have leap years", "does bread go stale", "do cats purr", "is the ocean salty",
        "does the moon have phases", "do onions make people cry", "does metal feel colder than wood",
        "do airplanes leave white trails", "do we get goosebumps", "does a compass point north",
        "is exercise good for sleep", "do stars twinkle", "does popcorn pop")
_HOW = ("a refrigerator keeps food cold", "vaccines train the immune system", "a bicycle stays upright",
        "noise-cancelling headphones work", "a search engine ranks pages", "solar panels make electricity",
        "a credit card payment is processed", "bees make honey", "GPS finds your position", "a dam generates power",
        "a thermostat controls a heater", "compound interest grows savings")
_PAIRS = (("weather", "climate"), ("a virus", "a bacterium"), ("RAM", "disk storage"), ("a loan", "a lease"),
          ("speed", "velocity"), ("an alligator", "a crocodile"), ("baking soda", "baking powder"),
          ("a comet", "an asteroid"), ("a debit card", "a credit card"), ("TCP", "UDP"),
          ("a simile", "a metaphor"), ("renewable", "non-renewable energy"))
_QA_ASKS = ("Explain in a short paragraph.", "Answer in three or four sentences.",
            "Give a clear answer a twelve-year-old could follow.", "Explain briefly, then give one example.")

_LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese", "Dutch")
_SUBJECTS = ("The museum", "The pharmacy", "Our office", "The swimming pool", "The bakery on the corner",
             "The city library", "The post office", "The sports centre")
_TIMES = ("opens at eight in the morning", "closes early on Fridays", "is closed on public holidays",
          "will be renovated next spring", "is busiest on Saturday mornings", "has new opening hours from May")
_AFTER = ("Please bring your ticket with you.", "Tickets can be bought online or at the entrance.",
          "Children under twelve enter for free.", "We apologise for any inconvenience.",
          "Dogs are not allowed inside.", "Visitors should use the side door during the works.",
          "Questions can be sent to the front desk by email.")

_CODE_TASKS = ("`{name}(items)` that returns the items that appear more than once, in order of first appearance",
               "`{name}(text)` that counts how often each word occurs, ignoring case and punctuation",
               "`{name}(matrix)` that returns the transpose of a list of equal-length lists",
               "`{name}(n)` that returns the first n Fibonacci numbers as a list",
               "`{name}(path)` that returns the number of non-empty lines in a text file",
               "`{name}(intervals)` that merges overlapping (start, end) intervals",
               "`{name}(s)` that checks whether a string is a palindrome, ignoring spaces and case",
               "`{name}(records, key)` that groups a list of dicts by the value of `key`",
               "`{name}(seconds)` that formats a duration as H:MM:SS",
               "`{name}(numbers)` that returns the running average after each element")
_CODE_NAMES = ("solve", "process", "compute", "helper", "transform")
_CODE_ASKS = ("Add type hints and a short docstring.", "Raise a ValueError on invalid input.",
              "Include two example calls.", "Keep it under 20 lines.")


def _prose_passages(min_chars: int = 300, max_chars: int = 900) -> list[str]:
    """Prose paragraphs of the Python reference shipped with the standard library
    (``pydoc_data.topics``; code and grammar blocks left out), each cut to ``max_chars``."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        topics = {}
    passages = []
    for key in sorted(topics):
        for block in topics[key].split("\n\n"):
            lines = block.splitlines()
            if not lines or any(line.startswith((" ", "*", "=", ">>>")) for line in lines):
                continue
            text = " ".join(line.strip() for line in lines)
            if len(text) >= min_chars // 3:
                passages.append(text)
    out, current = [], ""
    for text in passages:  # join short paragraphs until a passage is long enough
        current = f"{current}\n\n{text}" if current else text
        if len(current) >= min_chars:
            out.append(_cut_words(current, max_chars))
            current = ""
    return out


def _cut_words(text: str, limit: int) -> str:
    """``text`` cut after the last full sentence (or word) within ``limit`` characters."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    end = head.rfind(". ")
    return head[:end + 1] if end > limit // 2 else head.rsplit(" ", 1)[0]


def _task_prompt(kind: str, rng: random.Random, passages: Sequence[str]) -> str:
    pick = rng.choice
    if kind == "writing":
        if rng.random() < 0.6:
            return (f"Write {pick(_WRITING_KINDS)} to {pick(_PEOPLE)} about {pick(_WRITING_TOPICS)}. "
                    f"{pick(_WRITING_ASKS)}")
        return pick(_FREEFORM).format(thing=pick(_THINGS))
    if kind == "qa":
        r = rng.random()
        if r < 0.4:
            question = f"Why {pick(_WHY)}?"
        elif r < 0.7:
            question = f"Describe how {pick(_HOW)}."
        else:
            a, b = pick(_PAIRS)
            question = f"What is the difference between {a} and {b}?"
        return f"{question} {pick(_QA_ASKS)}"
    if kind == "math_reasoning":
        return _math_problem(rng) + " Reason step by step, then give the final answer."
    if kind == "translation":
        if passages and rng.random() < 0.4:
            text = _cut_words(pick(passages), 320)
        else:
            text = f"{pick(_SUBJECTS)} {pick(_TIMES)}. {pick(_AFTER)} {pick(_AFTER)}"
        return f"Translate the following text into {pick(_LANGUAGES)}:\n\n\"{text}\""
    if kind == "summarization":
        text = pick(passages) if passages else " ".join(rng.sample(_AFTER, 4))
        return f"Summarize the following text in {rng.choice((2, 3))} sentences.\n\n{text}"
    if kind == "rag":
        text = pick(passages) if passages else " ".join(rng.sample(_AFTER, 4))
        words = sorted({w.strip(".,;:()\"'") for w in text.split() if len(w) > 7 and w.isalpha()})
        about = pick(words) if words else "this"
        return (f"Context:\n{text}\n\nQuestion: According to the context, what is said about \"{about}\"? "
                "Answer using only the context, in two or three sentences.")
    if kind == "code":
        task = pick(_CODE_TASKS).format(name=pick(_CODE_NAMES))
        return f"Write a Python function {task}. {pick(_CODE_ASKS)}"
    raise ValueError(f"unknown task kind {kind!r}; known: {', '.join(TASK_KINDS)}")


def _math_problem(rng: random.Random) -> str:
    """A word problem with random numbers (one of several templates)."""
    r = rng.randint
    form = rng.randrange(6)
    if form == 0:
        a, n = r(2, 9), r(11, 40)
        b = r(4 * a, 6 * a - 1)  # a pack is cheaper than six single pens
        return (f"A shop sells pens for ${a} each or in packs of 6 for ${b}. Lee needs exactly {n} pens. "
                "What is the least amount of money Lee can pay?")
    if form == 1:
        v, t1, t2 = r(40, 110), r(2, 5), r(15, 50)
        return (f"A train travels at {v} km/h for {t1} hours and then stops for {t2} minutes. How far has it "
                f"gone, and how long did the journey take in total?")
    if form == 2:
        p, d = r(20, 400), rng.choice((10, 15, 20, 25, 30))
        return (f"A jacket costs ${p}. It is reduced by {d}% and then a further 10% at the till. What is the "
                "final price?")
    if form == 3:
        a, b = r(5, 30), r(2, 6)
        return (f"Sara is {a} years old and her father is {b} times her age. In how many years will her father "
                "be exactly twice her age?")
    if form == 4:
        w, h, c = r(3, 12), r(2, 9), r(8, 40)
        return (f"A room is {w} m long and {h} m wide. Tiles cost ${c} per square metre, and 10% extra must be "
                "bought for cutting. How much do the tiles cost?")
    n, k = r(20, 60), r(3, 9)
    return (f"A class of {n} students is split into groups of {k}. The students left over join existing groups, "
            "one per group. How many groups are there, and how many groups have an extra student?")


def _check_kinds(caller: str, kinds: Sequence[str]) -> list[str]:
    """``kinds`` as a list, refused if empty or naming a kind outside :data:`TASK_KINDS`."""
    kinds = list(kinds)
    if not kinds:
        raise ValueError(f"{caller} needs at least one kind")
    for kind in kinds:
        if kind not in TASK_KINDS:
            raise ValueError(f"unknown task kind {kind!r}; known: {', '.join(TASK_KINDS)}")
    return kinds
