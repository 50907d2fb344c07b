"""A deterministic, deliberately *regular* chat corpus made by the project (no download), so that a tiny
target continues predictably; one ``random.Random(seed)`` stream; held out by a hash of the prompt alone.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# Bump when templates change: build caches hash it.
CORPUS_VERSION = "1"

# One prompt in ten is held out (by hash of its text).
EVAL_FRACTION_PER_MILLE = 100


@dataclass(frozen=True)
class ChatExample:
    """One templated exchange: an optional system prompt, a user prompt and a reference answer."""

    family: str
    prompt: str
    answer: str
    system: str | None = None

    def conversations(self, *, with_answer: bool = True) -> list[dict[str, str]]:
        """The exchange as ChatML-style turns (the dataset format used by the pipeline)."""
        turns: list[dict[str, str]] = []
        if self.system is not None:
            turns.append({"role": "system", "content": self.system})
        turns.append({"role": "user", "content": self.prompt})
        if with_answer:
            turns.append({"role": "assistant", "content": self.answer})
        return turns


def split_of(prompt: str) -> str:
    """``"eval"`` or ``"train"``, from a hash of the prompt text only (stable across runs and seeds)."""
    digest = hashlib.sha256(("dflash-flow-heldout:" + prompt).encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:4], "big") % 1000 < EVAL_FRACTION_PER_MILLE else "train"


NAMES = [
    "Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jack", "Kate", "Leo",
    "Mia", "Noah", "Olivia", "Paul", "Rosa", "Sam", "Tina", "Victor", "Wendy", "Yusuf", "Zoe", "Omar",
]
ITEMS = [
    "apples", "books", "coins", "pencils", "stickers", "marbles", "cookies", "cards", "stamps", "shells",
    "balloons", "candles", "oranges", "buttons", "flowers", "toys",
]
ANIMALS = [
    "fox", "rabbit", "owl", "bear", "cat", "dog", "turtle", "mouse", "deer", "duck", "frog", "wolf",
    "horse", "goat", "squirrel", "hedgehog",
]
ADJECTIVES = ["little", "brave", "curious", "quiet", "clever", "kind", "sleepy", "happy", "shy", "old"]
PLACES = [
    "a green forest", "a small village", "a big city", "a sunny island", "a snowy mountain",
    "a quiet valley", "an old farm", "a river bank", "a busy harbor", "a desert town",
]
SPOTS = ["river", "hill", "market", "garden", "lake", "bridge", "meadow", "library"]
FOODS = ["berries", "bread", "honey", "seeds", "apples", "cheese", "nuts", "carrots"]
OBJECTS = ["a red key", "a shiny stone", "a lost map", "a golden bell", "a wooden box", "a blue feather"]
WORDS = [
    "garden", "window", "planet", "river", "music", "yellow", "market", "silver", "forest", "candle",
    "bridge", "rocket", "winter", "summer", "pencil", "little", "orange", "castle", "dragon", "harbor",
    "ladder", "mirror", "number", "pocket", "rabbit", "shadow", "ticket", "travel", "valley", "wonder",
    "apple", "house", "cloud", "green", "water", "light", "stone", "table", "paper", "chair", "bread",
    "tiger", "zebra", "ocean", "piano", "quiet", "smile", "train", "bottle", "butter", "kitten",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
    "November", "December",
]
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Tokyo", "Rome", "Quito", "Dublin", "Seoul", "Lagos"]
JOBS = ["teacher", "baker", "doctor", "pilot", "farmer", "painter", "nurse", "driver", "chef"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a patient tutor. Answer step by step.",
    "You are a concise assistant.",
    "You are a friendly assistant who likes clear lists.",
]

# Unit conversions: (from plural, from singular, to plural, factor).
CONVERSIONS = [
    ("kilometers", "kilometer", "meters", 1000), ("meters", "meter", "centimeters", 100),
    ("centimeters", "centimeter", "millimeters", 10), ("hours", "hour", "minutes", 60),
    ("minutes", "minute", "seconds", 60), ("days", "day", "hours", 24), ("weeks", "week", "days", 7),
    ("kilograms", "kilogram", "grams", 1000), ("liters", "liter", "milliliters", 1000),
    ("feet", "foot", "inches", 12), ("yards", "yard", "feet", 3), ("dozens", "dozen", "items", 12),
]


def _join(values: list) -> str:
    return ", ".join(str(v) for v in values)


# Families: each takes the shared rng and returns (prompt, answer).


def _word_problem(rng: random.Random) -> tuple[str, str]:
    name, friend = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    total = rng.randint(5, 60)
    n_steps = rng.randint(1, 5)
    story = [f"{name} has {total} {item}."]
    lines = [f"Start: {name} has {total} {item}."]
    for step in range(1, n_steps + 1):
        if rng.random() < 0.5 or total < 3:
            k = rng.randint(2, 30)
            verb = rng.choice(["buys", "finds", "gets"])
            story.append(f"Then {name} {verb} {k} more.")
            new = total + k
            lines.append(f"Step {step}: {name} {verb} {k} more. {total} + {k} = {new}.")
        else:
            k = rng.randint(1, total - 1)
            story.append(f"Then {name} gives {k} to {friend}.")
            new = total - k
            lines.append(f"Step {step}: {name} gives {k} to {friend}. {total} - {k} = {new}.")
        total = new
    prompt = " ".join(story) + f" How many {item} does {name} have now?"
    answer = "Let's solve it step by step.\n" + "\n".join(lines) + f"\nAnswer: {name} has {total} {item} now."
    return prompt, answer


def _counting(rng: random.Random) -> tuple[str, str]:
    step = rng.choice([1, 1, 1, 2, 3, 5, 10])
    start = rng.randint(0, 200)
    count = rng.randint(4, 70)
    end = start + step * (count - 1)
    values = list(range(start, end + 1, step))
    if rng.random() < 0.3:
        values.reverse()
        start, end = end, start
    by = "" if step == 1 else f" in steps of {step}"
    prompt = rng.choice(["Count from {a} to {b}{by}.", "Please count from {a} to {b}{by}.",
                         "List the numbers from {a} to {b}{by}."]).format(a=start, b=end, by=by)
    answer = (f"Here are the numbers from {start} to {end}{by}:\n{_join(values)}.\n"
              f"That makes {len(values)} numbers in total.")
    return prompt, answer


def _times_table(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(2, 19)
    a = rng.randint(1, 10)
    b = a + rng.randint(4, 20)
    prompt = rng.choice(["Write the multiplication table of {n} from {a} to {b}.",
                         "Show the {n} times table from {a} to {b}."]).format(n=n, a=a, b=b)
    rows = "\n".join(f"{n} x {i} = {n * i}" for i in range(a, b + 1))
    answer = f"Here is the multiplication table of {n}:\n{rows}\nThat is {b - a + 1} rows."
    return prompt, answer


def _sorting(rng: random.Random) -> tuple[str, str]:
    values = rng.sample(range(1, 100), rng.randint(3, 16))
    descending = rng.random() < 0.35
    order = "from largest to smallest" if descending else "from smallest to largest"
    ordered = sorted(values, reverse=descending)
    prompt = f"Sort these numbers {order}: {_join(values)}."
    answer = (f"Sorted {order}: {_join(ordered)}.\n"
              f"The smallest number is {min(values)} and the largest number is {max(values)}.\n"
              f"There are {len(values)} numbers.")
    return prompt, answer


def _spelling(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    if rng.random() < 0.5:
        prompt = f'Spell the word "{word}" letter by letter.'
        answer = (f'The word "{word}" is spelled: {"-".join(word)}.\n'
                  f"It has {len(word)} letters. The first letter is {word[0]} and the last letter is {word[-1]}.")
    else:
        words = rng.sample(WORDS, rng.randint(2, 8))
        prompt = f"Spell each of these words backwards: {_join(words)}."
        lines = "\n".join(f"{i}. {w} -> {w[::-1]}" for i, w in enumerate(words, 1))
        answer = f"Here are the words spelled backwards:\n{lines}\nThat is {len(words)} words."
    return prompt, answer


def _conversion(rng: random.Random) -> tuple[str, str]:
    src, src_one, dst, factor = rng.choice(CONVERSIONS)
    k = rng.randint(1, 6)
    values = sorted(rng.sample(range(2, 40), k))
    if k == 1:
        v = values[0]
        prompt = f"Convert {v} {src} to {dst}."
        answer = (f"There are {factor} {dst} in one {src_one}.\n"
                  f"So {v} {src} = {v} x {factor} = {v * factor} {dst}.")
    else:
        prompt = f"Convert each of these to {dst}: {_join(f'{v} {src}' for v in values)}."
        lines = "\n".join(f"- {v} {src} = {v} x {factor} = {v * factor} {dst}" for v in values)
        answer = f"There are {factor} {dst} in one {src_one}.\n{lines}\nThat is {k} conversions."
    return prompt, answer


def _calendar(rng: random.Random) -> tuple[str, str]:
    seq, unit = (DAYS, "days") if rng.random() < 0.5 else (MONTHS, "months")
    start = rng.randrange(len(seq))
    k = rng.randint(3, 20)
    prompt = f"List {k} {unit} in order, starting from {seq[start]}."
    values = [seq[(start + i) % len(seq)] for i in range(k)]
    answer = f"Starting from {seq[start]}, the next {k} {unit} are:\n{_join(values)}.\nThe last one is {values[-1]}."
    return prompt, answer


def _alphabet(rng: random.Random) -> tuple[str, str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    a = rng.randrange(0, 20)
    b = rng.randrange(a + 3, 26)
    upper = rng.random() < 0.3
    span = letters[a : b + 1].upper() if upper else letters[a : b + 1]
    case = "capital letters" if upper else "letters"
    prompt = f"Write the {case} of the alphabet from {span[0]} to {span[-1]}."
    answer = f"The {case} from {span[0]} to {span[-1]} are: {_join(list(span))}.\nThat is {len(span)} letters."
    return prompt, answer


def _compare(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(1, 1000), 2)
    hi, lo = max(a, b), min(a, b)
    prompt = rng.choice(["Which is larger, {a} or {b}?", "Which number is bigger: {a} or {b}?"]).format(a=a, b=b)
    answer = f"{hi} is larger than {lo}, because {hi} - {lo} = {hi - lo}, which is more than zero."
    return prompt, answer


_LOOP = "    result = {}\n    for x in numbers:\n{}\n    return result"
_OPS = [  # (name, description, function body, its value)
    ("total", "sum", _LOOP.format(0, "        result = result + x"), sum),
    ("product", "product", _LOOP.format(1, "        result = result * x"), math.prod),
    ("largest", "largest value", _LOOP.format("numbers[0]", "        if x > result:\n            result = x"), max),
    ("count_even", "number of even values", _LOOP.format(0, "        if x % 2 == 0:\n            result = result + 1"),
     lambda xs: sum(1 for x in xs if x % 2 == 0)),
]


def _code(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        op_name, desc, body, fn = rng.choice(_OPS)
        fname = f"{op_name}_{rng.choice(['of', 'in', 'for'])}_{rng.choice(['list', 'numbers', 'values', 'items'])}"
        xs = [rng.randint(1, 9) for _ in range(rng.randint(2, 5))]
        val = fn(xs)
        prompt = f"Write a Python function called {fname} that returns the {desc} of a list of numbers."
        answer = (f"Here is the function:\n```python\ndef {fname}(numbers):\n{body}\n```\n"
                  f"For example, {fname}([{_join(xs)}]) returns {val}.")
    elif kind == 1:
        a = rng.randint(0, 20)
        b = a + rng.randint(2, 15)
        var = rng.choice(["i", "n", "k", "x"])
        prompt = f"Write a Python loop that prints the numbers from {a} to {b}."
        answer = (f"Here is the loop:\n```python\nfor {var} in range({a}, {b + 1}):\n    print({var})\n```\n"
                  f"It prints:\n" + "\n".join(str(i) for i in range(a, b + 1)))
    else:
        cls = rng.choice(["Person", "Book", "Car", "City", "Pet", "Order", "Point", "Song"])
        fields = rng.sample(["name", "age", "color", "size", "price", "title", "owner", "year", "speed",
                             "weight", "label", "score"], rng.randint(2, 7))
        prompt = f"Write a Python class named {cls} with the fields {_join(fields)}."
        init_args = ", ".join(fields)
        assigns = "\n".join(f"        self.{f} = {f}" for f in fields)
        getters = "\n\n".join(f"    def get_{f}(self):\n        return self.{f}" for f in fields)
        answer = (f"Here is the class:\n```python\nclass {cls}:\n    def __init__(self, {init_args}):\n{assigns}\n\n"
                  f"{getters}\n```\nThe class {cls} has {len(fields)} fields.")
    return prompt, answer


def _json_records(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(1, 5)
    people = [(name, rng.randint(18, 80), rng.choice(CITIES), rng.choice(JOBS)) for name in rng.sample(NAMES, n)]
    desc = "; ".join(f"{p[0]}, {p[1]} years old, a {p[3]} from {p[2]}" for p in people)
    prompt = f"Make a JSON list of people from this description: {desc}."
    objs = ",\n".join(
        f'  {{\n    "name": "{p[0]}",\n    "age": {p[1]},\n    "city": "{p[2]}",\n    "job": "{p[3]}"\n  }}'
        for p in people
    )
    answer = f"Here is the JSON list:\n```json\n[\n{objs}\n]\n```\nThe list has {n} {'person' if n == 1 else 'people'}."
    return prompt, answer


def _story(rng: random.Random) -> tuple[str, str]:
    adj = rng.choice(ADJECTIVES)
    animal, animal2 = rng.sample(ANIMALS, 2)
    name, name2 = rng.sample(NAMES, 2)
    place = rng.choice(PLACES)
    parts = rng.randint(2, 7)
    prompt = rng.choice([
        "Tell a short story in {k} parts about a {adj} {animal} who lives in {place}.",
        "Write a story in {k} parts about a {adj} {animal} from {place}.",
    ]).format(k=parts, adj=adj, animal=animal, place=place)
    # A fixed pool of paragraph templates, used in order: the plot is predictable once the slots are known.
    spot, food, obj, color = rng.choice(SPOTS), rng.choice(FOODS), rng.choice(OBJECTS), rng.choice(COLORS)
    paragraphs = [
        f"Part 1. Once upon a time, there was a {adj} {animal} named {name} who lived in {place}. "
        f"Every morning, {name} walked to the {spot} to look for {food}.",
        f"Part 2. One day, {name} met a {animal2} called {name2}. {name2} said: \"Hello, {name}! "
        f"Do you want to be my friend?\" {name} said yes, and they shared the {food}.",
        f"Part 3. Near the {spot}, the two friends found {obj}. {name} wondered where it came from, "
        f"and {name2} wanted to find its owner.",
        f"Part 4. They asked everyone in {place}. Nobody knew the answer, so they walked until the sky "
        f"turned {color} and the stars came out.",
        f"Part 5. At last they met an old owl who said: \"That belongs to the moon.\" {name} and {name2} "
        f"climbed the tallest hill and gave it back.",
        "Part 6. The moon was very happy. It gave them a little light to carry home, so they were never "
        "afraid of the dark again.",
        f"Part 7. From that day on, {name} the {animal} and {name2} the {animal2} met at the {spot} every "
        f"morning, and they always shared their {food}.",
    ]
    answer = "\n\n".join(paragraphs[:parts]) + f"\n\nThe end. That was the story of {name} in {parts} parts."
    return prompt, answer


# (name, generator, weight). Weights favour the long, highly regular families a drafter can exploit.
FAMILIES: list[tuple[str, Callable[[random.Random], tuple[str, str]], int]] = [
    ("word_problem", _word_problem, 3), ("counting", _counting, 3), ("times_table", _times_table, 3),
    ("sorting", _sorting, 2), ("spelling", _spelling, 2), ("conversion", _conversion, 2), ("calendar", _calendar, 2),
    ("alphabet", _alphabet, 1), ("compare", _compare, 1), ("code", _code, 3), ("json", _json_records, 2),
    ("story", _story, 3),
]


def iter_examples(seed: int) -> Iterator[ChatExample]:
    """An endless, deterministic stream of examples (duplicates possible: callers dedupe by prompt)."""
    rng = random.Random(seed)
    names, gens, weights = zip(*FAMILIES, strict=True)
    while True:
        i = rng.choices(range(len(FAMILIES)), weights=weights)[0]
        prompt, answer = gens[i](rng)
        # About a quarter of the examples carry a system prompt, so the template's system turn is exercised.
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.25 else None
        yield ChatExample(family=names[i], prompt=prompt, answer=answer, system=system)


def make_split(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[ChatExample], list[ChatExample]]:
    """``n_train`` training and ``n_eval`` held-out examples with distinct prompts; sides come from
    :func:`split_of`, so they are disjoint and a side's first ``k`` do not depend on the other's size."""
    train: list[ChatExample] = []
    evals: list[ChatExample] = []
    seen: set[str] = set()
    limit = 200 * (n_train + n_eval) + 10_000  # guard against a template set too small to supply n distinct
    for draws, ex in enumerate(iter_examples(seed)):
        if len(train) >= n_train and len(evals) >= n_eval:
            break
        if draws > limit:
            raise RuntimeError(f"corpus ran out of distinct prompts ({len(train)} train, {len(evals)} eval)")
        if ex.prompt in seen:
            continue
        seen.add(ex.prompt)
        side = train if split_of(ex.prompt) == "train" else evals
        if len(side) < (n_train if side is train else n_eval):
            side.append(ex)
    return train, evals


def corpus_text(examples: list[ChatExample]) -> Iterator[str]:
    """Plain text of the examples (system, prompt, answer), e.g. to train the tokenizer on."""
    for ex in examples:
        if ex.system is not None:
            yield ex.system
        yield ex.prompt
        yield ex.answer
