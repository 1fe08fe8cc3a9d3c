"""The 19 function-style in-context-learning probes of the paper's appendix (SPEC 7), generated from word lists the
project builds itself, 10-shot, greedy continuation up to the first newline, exact match.

Prompt (SPEC 7, paper appendix "Prompting protocol"): every demonstration is ``Q:<input>\\nA:<output>\\n\\n`` and the
query ends at ``A:``; no instruction prefix.

Task definitions. The paper names the tasks (after Todd et al., Function Vectors) and shows one example
(``dog -> DOG`` for a capitalisation task); where a name leaves the mapping open we chose, and document here:

- ``alphabetically_first_k`` / ``alphabetically_last_k``: ``k`` distinct words joined by ``", "`` -> the first/last
  in alphabetical (code point) order.
- ``choose_first_of_k`` / ``choose_last_of_k`` / ``choose_middle_of_k``: ``k`` distinct words -> the one at that
  position.
- ``capitalize``: word -> the word in capitals (the paper's example ``dog -> DOG``).
- ``capitalize_first_letter`` / ``capitalize_last_letter``: word -> its first/last letter in capitals.
- ``lowercase_first_letter`` / ``lowercase_last_letter``: WORD in capitals -> its first/last letter in lowercase (an
  all-capitals input, so the answer is never a plain copy of the input's character).
- ``next_capital_letter``: a lowercase letter -> the next letter of the alphabet in capitals (``z -> A`` wraps).
- ``next_item`` / ``prev_item``: an item of a cyclic sequence (weekdays, months, lowercase letters) or of the number
  words one..twenty -> its successor/predecessor; the cyclic ones wrap (Sunday -> Monday, January -> December,
  z -> a); the number words do not (twenty has no successor, one no predecessor, so they are never asked).
- ``word_length``: word -> its number of characters, in digits.

Words: the most frequent purely alphabetic lowercase words (3 to 10 letters) of the corpus' training documents,
ties broken alphabetically (``build_word_list``). Queries are fixed per task (seeded by the task name); the 10
demonstrations of each query are drawn per demonstration seed and never share the query's input.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import statistics
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bdlora.base.errors import DataError
from bdlora.base.io import write_json
from bdlora.data.corpora import open_corpus, parse, teacher_tokens
from bdlora.data.documents import BUILTIN, is_heldout
from bdlora.data.tokens import default_cache_dir

TASKS = (
    "alphabetically_first_3", "alphabetically_first_5", "alphabetically_last_3", "alphabetically_last_5",
    "capitalize", "capitalize_first_letter", "capitalize_last_letter",
    "choose_first_of_3", "choose_first_of_5", "choose_last_of_3", "choose_last_of_5",
    "choose_middle_of_3", "choose_middle_of_5",
    "lowercase_first_letter", "lowercase_last_letter", "next_capital_letter",
    "next_item", "prev_item", "word_length",
)
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
LETTERS = tuple(string.ascii_lowercase)
NUMBER_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
                "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")
CYCLES = (WEEKDAYS, MONTHS, LETTERS)
SEPARATOR = ", "
WORD_RE = re.compile(r"[A-Za-z]+")


def format_prompt(demos: Sequence[tuple[str, str]], query: str) -> str:
    """SPEC 7: ``Q:<input>\\nA:<output>\\n\\n`` per demonstration, then ``Q:<query>\\nA:``."""
    return "".join(f"Q:{i}\nA:{o}\n\n" for i, o in demos) + f"Q:{query}\nA:"


def extract_answer(continuation: str) -> str:
    """The greedy continuation up to (not including) the first newline; nothing else is stripped (exact match)."""
    return continuation.split("\n", 1)[0]


def is_correct(continuation: str, target: str) -> bool:
    return extract_answer(continuation) == target


# ------------------------------------------------------------------------------------------------------------------
# Word list
# ------------------------------------------------------------------------------------------------------------------


def build_word_list(documents, size: int = 400, min_len: int = 3, max_len: int = 10) -> list[str]:
    """The ``size`` most frequent lowercase alphabetic words (``min_len``..``max_len`` letters) of ``documents``
    (an iterable of strings); ties broken alphabetically so the list is a pure function of the text."""
    counts: Counter[str] = Counter()
    for text in documents:
        counts.update(w for w in WORD_RE.findall(text) if w.islower() and min_len <= len(w) <= max_len)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return [w for w, _ in ranked[:size]]


def corpus_word_list(data: str, heldout_fraction: float, cache_dir: Path | None = None, size: int = 400) -> list[str]:
    """``build_word_list`` over the training documents of a corpus (``--data`` spec), cached by corpus fingerprint."""

    # the corpora a user wrote (a mixture's components); teacher samples are not a word source: builtin then
    specs = [p.spec for p in parse(data) if teacher_tokens(p.spec) is None] or [BUILTIN]
    corpora = [open_corpus(s, cache_dir) for s in specs]
    key = hashlib.sha256("|".join(c.fingerprint() for c in corpora).encode()).hexdigest()[:16]
    cache = (cache_dir or default_cache_dir()) / "icl" / f"words-{key}-{heldout_fraction}-{size}.json"
    if cache.exists():
        return json.loads(cache.read_text())["words"]
    fraction = lambda c: heldout_fraction if heldout_fraction is not None else c.default_heldout_fraction  # noqa: E731
    words = build_word_list((d.text for c in corpora for d in c.documents() if not is_heldout(d.id, fraction(c))),
                            size)
    if len(words) < 20:
        raise DataError(f"--data {data}: only {len(words)} distinct lowercase words; the ICL probes need >= 20")
    write_json(cache, {"data": data, "heldout_fraction": heldout_fraction, "words": words})
    return words


# ------------------------------------------------------------------------------------------------------------------
# Probe generators: each returns one (input, output) pair drawn with ``rng``
# ------------------------------------------------------------------------------------------------------------------


def _sample(rng: random.Random, words: Sequence[str], k: int) -> list[str]:
    return rng.sample(list(words), k)


def _list_task(pick: Callable[[list[str]], str], k: int):
    def gen(rng, words):
        items = _sample(rng, words, k)
        return SEPARATOR.join(items), pick(items)
    return gen


def _word_task(fn: Callable[[str], tuple[str, str]]):
    def gen(rng, words):
        return fn(rng.choice(list(words)))
    return gen


def _sequence_items(step: int) -> list[tuple[str, str]]:
    """(item, successor) pairs for step=+1, (item, predecessor) for step=-1 over every sequence."""
    pairs = []
    for seq in CYCLES:
        pairs += [(seq[i], seq[(i + step) % len(seq)]) for i in range(len(seq))]
    rng = range(len(NUMBER_WORDS) - 1) if step > 0 else range(1, len(NUMBER_WORDS))
    pairs += [(NUMBER_WORDS[i], NUMBER_WORDS[i + step]) for i in rng]
    return pairs


NEXT_ITEMS = _sequence_items(+1)
PREV_ITEMS = _sequence_items(-1)

GENERATORS: dict[str, Callable[[random.Random, Sequence[str]], tuple[str, str]]] = {
    **{f"alphabetically_first_{k}": _list_task(min, k) for k in (3, 5)},
    **{f"alphabetically_last_{k}": _list_task(max, k) for k in (3, 5)},
    **{f"choose_first_of_{k}": _list_task(lambda xs: xs[0], k) for k in (3, 5)},
    **{f"choose_last_of_{k}": _list_task(lambda xs: xs[-1], k) for k in (3, 5)},
    **{f"choose_middle_of_{k}": _list_task(lambda xs: xs[len(xs) // 2], k) for k in (3, 5)},
    "capitalize": _word_task(lambda w: (w, w.upper())),
    "capitalize_first_letter": _word_task(lambda w: (w, w[0].upper())),
    "capitalize_last_letter": _word_task(lambda w: (w, w[-1].upper())),
    "lowercase_first_letter": _word_task(lambda w: (w.upper(), w[0].lower())),
    "lowercase_last_letter": _word_task(lambda w: (w.upper(), w[-1].lower())),
    "next_capital_letter": lambda rng, words: (lambda c: (c, LETTERS[(LETTERS.index(c) + 1) % 26].upper()))(
        rng.choice(LETTERS)),
    "next_item": lambda rng, words: rng.choice(NEXT_ITEMS),
    "prev_item": lambda rng, words: rng.choice(PREV_ITEMS),
    "word_length": _word_task(lambda w: (w, str(len(w)))),
}
assert set(GENERATORS) == set(TASKS)


@dataclass(frozen=True)
class Example:
    task: str
    seed: int
    prompt: str
    target: str


def task_examples(task: str, words: Sequence[str], examples: int, shots: int, seed: int) -> list[Example]:
    """``examples`` prompts of one task for one demonstration seed. The queries are the same for every seed
    (seeded by the task name); the demonstrations are drawn with the seed and never repeat the query's input."""
    if task not in GENERATORS:
        raise ValueError(f"unknown ICL task {task!r}")
    gen = GENERATORS[task]
    q_rng = random.Random(f"{task}/queries")
    d_rng = random.Random(f"{task}/demos/{seed}")
    out = []
    for _ in range(examples):
        q_in, q_out = gen(q_rng, words)
        demos: list[tuple[str, str]] = []
        while len(demos) < shots:
            d = gen(d_rng, words)
            if d[0] != q_in:
                demos.append(d)
        out.append(Example(task, seed, format_prompt(demos, q_in), q_out))
    return out


def summarise(correct: dict[str, dict[int, list[bool]]]) -> dict:
    """Per task: accuracy (%) per seed, mean and population std over seeds; the composite (macro average over tasks)
    with the paper's error bar, the mean of the per-task stds (its Table 9's composite row equals that in every
    column; ``std_of_seed_macro``, the std over seeds of the per-seed macro average, is kept beside it)."""
    tasks = {}
    seeds = sorted({s for per in correct.values() for s in per})
    for task, per_seed in correct.items():
        acc = {s: 100.0 * sum(v) / max(1, len(v)) for s, v in per_seed.items()}
        vals = [acc[s] for s in seeds]
        tasks[task] = {"per_seed": {str(s): acc[s] for s in seeds}, "mean": statistics.fmean(vals),
                       "std": statistics.pstdev(vals), "n": len(next(iter(per_seed.values())))}
    macro_per_seed = [statistics.fmean(t["per_seed"][str(s)] for t in tasks.values()) for s in seeds]
    return {"tasks": tasks, "macro": {**composite(tasks.values()),
                                      "std_of_seed_macro": statistics.pstdev(macro_per_seed),
                                      "per_seed": {str(s): v for s, v in zip(seeds, macro_per_seed)}}}


def composite(tasks) -> dict:
    """The ICL composite of per-task ``{"mean", "std"}``: mean of the means ± mean of the stds (the paper's form)."""
    tasks = list(tasks)
    return {"mean": statistics.fmean(t["mean"] for t in tasks), "std": statistics.fmean(t["std"] for t in tasks)}
