"""Prompts for speculative decoding on a chat model: training prompts made from templates, and fixed workloads.

A draft learns from text the target writes in answer to prompts (``minillm.eagle_train``), and its
speed is measured on other prompts (``python -m minillm bench real-speculation``). Both come from
here, so the measurement never sees a training prompt (``check_held_out``):

- ``training_prompts(n, seed)``: n distinct prompts drawn reproducibly from the cartesian product of
  topics and question forms (chat), tasks and request forms (code), and passages of the Shakespeare
  training split with an instruction (grounded: rewrite, summarize or extract).
- ``stdlib_prompts(n, seed)``: n prompts made from the Python standard library's docstrings and
  source (write a function from its docstring, explain a function's source, say what a module is
  for): far more varied than the templates, and on every machine that runs Python.
- ``stdlib_texts(n, seed)``: n conversations whose answer is fixed text the target did not write (a piece
  of a standard-library module's source, or a docstring, as the answer to a question about it): the
  target reads them teacher-forced, one prefill each, so its features on them cost no decoding.
- ``WORKLOADS``: fixed prompts of three kinds, written apart from the templates: ``chat``
  (questions), ``code`` (write a small Python function) and ``grounded`` (a paragraph given in the
  prompt to rewrite, summarize or extract from; prompt lookup's home ground).
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import numpy as np

KINDS = ("chat", "code", "grounded")

CHAT_TOPICS = (
    "the moon", "volcanoes", "the French Revolution", "coffee", "jazz music", "honeybees", "the Roman Empire",
    "electric cars", "the human brain", "rain forests", "the printing press", "earthquakes", "chocolate",
    "the Olympic Games", "sharks", "solar panels", "the Great Wall of China", "tea ceremonies", "glaciers",
    "the immune system", "penguins", "the stock market", "deserts", "the violin", "bread baking", "tides",
    "the Internet", "owls", "the pyramids of Egypt", "recycling", "the piano", "comets", "coral reefs",
    "the Renaissance", "wolves", "wind turbines", "the Amazon river", "cheese making", "hurricanes",
    "the telescope", "octopuses", "the Silk Road", "meditation", "dinosaurs", "the metric system",
    "origami", "lightning", "the Vikings", "yoga", "mountains", "the steam engine", "dolphins", "maps",
    "public libraries", "the periodic table", "gardening", "the ocean floor", "elections", "the camera",
    "bicycles", "snow", "the alphabet", "whales", "vaccines", "the calendar", "trains", "forests in winter",
    "money", "the heart", "clouds", "ancient Greece", "bees and flowers", "photography", "the Sahara",
)
CHAT_FORMS = (
    "What is {t}?", "Explain {t} in simple terms.", "Tell me three facts about {t}.", "Why is {t} important?",
    "Write a short paragraph about {t}.", "How would you describe {t} to a child?",
    "Give me a brief history of {t}.", "What are common misconceptions about {t}?",
    "Write a short poem about {t}.", "What would a day without {t} be like?",
    "List some interesting questions about {t}.", "Summarize what scientists know about {t}.",
)
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "finds the largest element of a list", "removes duplicates from a list",
    "checks whether a string is a palindrome", "computes the factorial of n", "sorts a list of numbers",
    "merges two sorted lists", "returns the sum of the digits of a number", "converts Celsius to Fahrenheit",
    "counts the words in a sentence", "flattens a nested list", "returns the average of a list of numbers",
    "finds the greatest common divisor of two numbers", "capitalizes every word in a sentence",
    "checks whether two strings are anagrams", "returns the even numbers of a list",
    "computes the area of a circle", "finds the second largest number in a list", "reads a file and counts its lines",
    "returns a dictionary of letter counts", "checks whether a year is a leap year", "reverses a list in place",
    "returns the n smallest items of a list", "converts a binary string to an integer",
    "finds the index of an item in a sorted list with binary search", "computes the power of a number",
    "returns the longest word in a sentence", "checks whether a list is sorted",
    "swaps the keys and values of a dictionary",
    "removes the whitespace from a string", "returns the product of a list of numbers",
    "computes the mean and median of a list", "counts how often each item appears in a list",
)
CODE_FORMS = (
    "Write a Python function that {t}.", "Write a short Python function that {t}, with a docstring.",
    "How do I write a Python function that {t}?", "Implement a function in Python that {t}.",
    "Show me Python code for a function that {t}.",
)
GROUNDED_FORMS = (
    "Rewrite the following passage in plain modern English:\n\n{t}",
    "Summarize this passage in two sentences:\n\n{t}",
    "Which characters speak in this passage, and what do they say?\n\n{t}",
    "Repeat the first two lines of this passage, then explain them:\n\n{t}",
)
PASSAGE_CHARS = 400  # a grounded prompt's passage: about a hundred tokens


def check_count(n, what: str) -> None:
    """ValueError unless n, how many ``what`` to make, is an int >= 1."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of {what} must be an int >= 1, got {n!r}")


def passages(text: str, n: int, seed: int) -> list[str]:
    """n passages of about PASSAGE_CHARS characters, each starting and ending at a line break."""
    rng = np.random.default_rng(seed)
    out = []
    for start in rng.integers(0, len(text) - 2 * PASSAGE_CHARS, size=n):
        begin = text.index("\n", int(start)) + 1
        end = text.rindex("\n", begin, begin + PASSAGE_CHARS)
        out.append(text[begin:end].strip())
    return out


def training_prompts(n: int, seed: int = 0, grounded_share: float = 0.15) -> list[dict]:
    """n distinct prompts {"prompt", "kind"}, a reproducible draw (chat and code: about 2:1)."""
    from .data import TRAIN_FRACTION, load_corpus

    check_count(n, "training prompts")
    rng = np.random.default_rng(seed)
    chat = [{"prompt": f.format(t=t), "kind": "chat"} for t, f in itertools.product(CHAT_TOPICS, CHAT_FORMS)]
    code = [{"prompt": f.format(t=t), "kind": "code"} for t, f in itertools.product(CODE_TASKS, CODE_FORMS)]
    n_grounded = int(round(n * grounded_share))
    text = load_corpus()
    train_text = text[: int(TRAIN_FRACTION * len(text))]  # the character model's training split
    grounded = [{"prompt": GROUNDED_FORMS[i % len(GROUNDED_FORMS)].format(t=p), "kind": "grounded"}
                for i, p in enumerate(passages(train_text, n_grounded, seed))]
    pool = [chat[i] for i in rng.permutation(len(chat))] + [code[i] for i in rng.permutation(len(code))]
    if n - n_grounded > len(pool):
        raise ValueError(f"at most {len(pool) + n_grounded} training prompts can be made, asked for {n}")
    order = rng.permutation(len(pool))[: n - n_grounded]
    prompts = [pool[i] for i in sorted(order)] + grounded
    return [prompts[i] for i in rng.permutation(len(prompts))]


STDLIB_SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "__pycache__"}
SOURCE_CHARS = 1200  # the longest function source a prompt quotes (about 300 tokens)
STDLIB_FORMS = {
    "code": ("Write a Python function {name}{args} that does this: {doc}",
             "Implement {name}{args} in Python. {doc}"),
    "grounded": ("Explain what this Python function does, step by step:\n\n```python\n{source}\n```",
                 "Write a short docstring for this Python function:\n\n```python\n{source}\n```"),
    "chat": ("What is the Python module {module} for? Its documentation begins:\n\n{doc}",),
}


def stdlib_files(root=None) -> list:
    """The Python standard library's own modules, sorted by path (no tests, no installed packages)."""
    import sysconfig

    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not STDLIB_SKIP & set(p.relative_to(root).parts[:-1]))


def first_sentences(doc: str, limit: int = 300) -> str:
    """A docstring's first paragraph on one line, cut at a sentence end within ``limit`` characters."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    if len(text) <= limit:
        return text
    cut = text.rfind(". ", 0, limit)
    return text[: cut + 1] if cut > 0 else text[:limit]


LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")  # a line with its end, as ast splits source


def source_segment(lines: list, node) -> str | None:
    """``ast.get_source_segment(source, node)`` from the source's lines (``LINE.findall(source)``), split once
    per file: ast splits the whole source again on every call, minutes over the standard library."""
    if getattr(node, "end_lineno", None) is None or getattr(node, "end_col_offset", None) is None:
        return None
    a, b = node.lineno - 1, node.end_lineno - 1
    if a == b:
        return lines[a].encode()[node.col_offset:node.end_col_offset].decode()
    return "".join([lines[a].encode()[node.col_offset:].decode(), *lines[a + 1:b],
                    lines[b].encode()[:node.end_col_offset].decode()])


def stdlib_modules(root=None):
    """(module name, source, parsed tree) of every standard-library module that parses (``stdlib_files``)."""
    import ast

    for path in stdlib_files(root):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        yield (".".join(path.with_suffix("").parts[-2:]) if path.name == "__init__.py" else path.stem), source, tree


def distinct_draw(pool: list, n: int, seed: int, make, what: str) -> list[dict]:
    """n distinct items ``make(pool[i], rng)`` for pool indices in a reproducible random order."""
    rng = np.random.default_rng(seed)
    out, seen = [], set()
    for i in rng.permutation(len(pool)):
        item = make(pool[i], rng)
        key = (item["prompt"], item.get("answer"))
        if key not in seen:
            seen.add(key)
            out.append(item)
            if len(out) == n:
                return out
    raise ValueError(f"at most {len(out)} {what} can be made here, asked for {n}")


# Everyday requests for advice, the kind of chat the topic templates above do not ask: what a person wants to
# do or fix, and the ways of asking. Written for the draft's data; no situation is one of
# docs/unseen_prompts.jsonl's chat prompts' (neighbours and noise, packing for a trip, food that goes stale,
# studying at home), so that those stay unseen (``advice_prompts``).
ADVICE_SITUATIONS = (
    "start running without hurting my knees", "save money on groceries each month", "learn to cook simple meals",
    "keep my houseplants alive", "fall asleep faster", "prepare for a job interview", "ask my boss for a raise",
    "write a polite complaint to a company", "organize a small birthday party", "teach my child to ride a bike",
    "clean a burnt pan", "remove a coffee stain from a shirt", "start a vegetable garden on a balcony",
    "make new friends in a new city", "drink more water during the day",
    "choose a good used car", "fix a squeaky door", "keep my cat off the kitchen table",
    "train my puppy to walk on a leash", "prepare my first presentation at work",
    "plan a budget for the first time", "decorate a small apartment cheaply", "learn to play the guitar",
    "write a thank-you note to a teacher", "cut down on sugar", "get up earlier in the morning",
    "keep a conversation going on a first date", "say no to extra work politely", "start journaling",
    "help an elderly parent use a smartphone", "choose a gift for a coworker", "paint a room",
    "get rid of fruit flies in the kitchen", "keep my car clean inside", "learn a new language as an adult",
    "deal with a rude customer", "recover after a long flight", "motivate myself to exercise in winter",
    "make my mornings less rushed", "split chores fairly with my roommates", "apologize to a friend",
    "organize my email inbox", "plan a picnic with children",
    "care for a sunburn", "choose running shoes", "reduce stress after work", "build a reading habit",
    "clean windows without streaks", "prepare a simple vegetarian dinner for guests", "negotiate rent",
    "back up the photos on my phone", "start volunteering in my town", "keep my bike from rusting",
    "talk to my teenager about screen time", "stay warm in a cold house", "make a long drive less tiring",
    "welcome a new colleague to the team", "plan meals for a busy week", "fix a slow laptop",
)
ADVICE_FORMS = (
    "How can I {s}?", "What is the best way to {s}?", "I want to {s}. Where should I start?",
    "Can you give me some tips to {s}?", "What mistakes should I avoid when I try to {s}?",
    "My friend asked me how to {s}. What should I tell them?", "Give me a simple plan to {s}.",
    "Is it hard to {s}? What would you suggest?", "I have tried and failed to {s}. Any advice?",
    "What do I need to {s}?", "Explain step by step how to {s}.", "I'm a beginner. How do I {s}?",
)


def pair_prompts(subjects: tuple, forms: tuple, kind: str, n: int, seed: int, what: str) -> list[dict]:
    """n distinct prompts of one kind, every subject in every form once at most, a reproducible draw."""
    check_count(n, what)
    pool = list(itertools.product(subjects, forms))
    return distinct_draw(pool, n, seed, lambda entry, rng: {"prompt": entry[1].format(s=entry[0]), "kind": kind}, what)


def advice_prompts(n: int, seed: int = 0) -> list[dict]:
    """n distinct chat prompts asking for everyday advice (ADVICE_SITUATIONS x ADVICE_FORMS), a reproducible
    draw: chat as people ask it beside the topic templates' "Explain {t}" (``eagle-data --source advice``)."""
    return pair_prompts(ADVICE_SITUATIONS, ADVICE_FORMS, "chat", n, seed, "advice prompts")


# Everyday questions of "why" (chat) and small programs as people ask for them (code), written for the draft's
# data like the advice above: no subject is one of docs/unseen_prompts.jsonl's (no food that goes stale, no
# chunks of a list, bank accounts, CSV columns or words by length), checked in tests/test_workloads.py.
WHY_FACTS = (
    "the sky is blue", "leaves change colour in autumn", "ice floats on water", "onions make our eyes water",
    "cats purr", "we yawn", "the sea is salty", "we get goosebumps", "metal feels colder than wood",
    "soap removes grease", "a rainbow appears after rain", "our voice sounds strange on a recording",
    "hot air balloons rise", "planes can fly", "we dream at night", "the moon changes shape during the month",
    "popcorn pops", "fingers wrinkle in the bath", "we see lightning before we hear thunder", "stars twinkle",
    "salt melts ice on roads", "a spoon looks bent in a glass of water", "bubbles are round", "we have fingerprints",
    "the days are shorter in winter", "some people are left-handed", "birds fly south in winter", "we get hiccups",
    "a candle flame points upward", "our ears pop on a plane", "the ocean has waves", "cold water makes teeth hurt",
    "a ship made of steel floats", "we feel dizzy after spinning", "grass is green",
    "the moon looks bigger near the horizon", "music can give us chills", "clocks change in spring",
    "magnets stick to the fridge", "the Earth has seasons", "we need to sleep", "glass is transparent",
    "sunsets are red", "tomatoes are called a fruit", "a moving bicycle stays upright", "copper turns green over time",
    "we blink", "mirrors swap left and right", "a microwave heats soup", "the Dead Sea lets people float",
    "frogs croak at night", "hair turns grey with age", "yawning is contagious", "deserts are cold at night",
    "ants walk in lines", "a kettle whistles", "the tide comes in twice a day", "we sneeze",
    "paper turns yellow with age", "owls can turn their heads so far",
)
WHY_FORMS = (
    "Can you explain why {s}?", "I have always wondered why {s}. What is the reason?",
    "Explain to a ten-year-old why {s}.", "What is the science behind the fact that {s}?",
    "Is it true that {s}? If so, why?", "My daughter asked me why {s}. How should I answer?",
    "In a few sentences, explain why {s}.", "Give me a simple explanation of why {s}.", "Why is it that {s}?",
    "I read that {s}. Can you tell me why?", "How come {s}?", "Tell me why {s}, with an everyday example.",
)
PROGRAMS = (
    "a function that returns the most common word in a text",
    "a function that checks whether a password has eight characters, a digit and a capital letter",
    "a class for a to-do list with methods to add, remove and show tasks",
    "a function that merges two dictionaries, adding the values of shared keys",
    "a function that groups a list of words by their first letter",
    "a function that returns the number of days between two dates",
    "a function that writes a list of dictionaries to a JSON file",
    "a function that finds all the files with a given extension in a folder",
    "a class for a rectangle with area and perimeter methods", "a function that removes the punctuation from a string",
    "a function that rotates a list by k positions",
    "a function that returns the intersection of two lists without duplicates",
    "a function that converts a Roman numeral to an integer",
    "a function that checks whether the parentheses in a string are balanced",
    "a class for a stack with push, pop and peek methods", "a class for a queue built on two lists",
    "a function that counts the characters, words and lines of a text",
    "a function that returns the transpose of a matrix given as a list of lists",
    "a function that generates a random password", "a function that checks an email address with a regular expression",
    "a function that returns the running total of a list of numbers",
    "a function that finds the longest common prefix of a list of strings",
    "a function that converts a number of seconds to hours, minutes and seconds",
    "a class for a temperature sensor that keeps its last ten readings",
    "a function that replaces every vowel in a string with a star",
    "a function that returns the pairs of numbers in a list that add up to a target",
    "a function that prints the lines of a text file in reverse order",
    "a function that computes the total price of a shopping cart with a discount",
    "a class for a library book with a title, an author and a borrowed flag",
    "a function that returns the unique characters of a string in the order they appear",
    "a function that checks whether a number is a perfect square", "a function that returns the first n prime numbers",
    "a function that converts a string to title case without str.title",
    "a function that finds the missing number in a list of the numbers 1 to n",
    "a function that returns the median of three numbers",
    "a class for a point in two dimensions with a distance method",
    "a function that calls another function again, up to three times, when it raises an exception",
    "a decorator that prints how long a function takes",
    "a function that counts how many times each letter appears in a file",
    "a function that returns the keys of a dictionary ordered by their values",
    "a function that checks whether a string contains only digits",
    "a function that turns a list of tuples into a dictionary",
    "a generator that yields the Fibonacci numbers below a limit",
    "a function that counts the uppercase and lowercase letters in a string",
    "a class for a counter that can be incremented, decremented and reset",
    "a function that removes the empty strings from a list",
    "a function that compresses a string by counting repeated letters, so aaabb becomes a3b2",
    "a function that parses a date written as day/month/year",
    "a function that returns the distance between two places given their latitudes and longitudes",
    "a function that finds the most frequent item in a list",
    "a function that shuffles a deck of cards and deals five of them",
    "a function that returns the digits of a number as a list",
    "a class for a shopping cart with add_item, remove_item and total methods",
    "a function that checks whether a sentence uses every letter of the alphabet",
    "a function that returns the common elements of three lists",
    "a function that prints a multiplication table for a number",
    "a function that converts a hexadecimal string to a decimal number",
    "a function that returns every second element of a list",
    "a function that counts the files in a folder and its subfolders",
    "a function that saves a dictionary to a text file, one key and value per line",
)
PROGRAM_FORMS = (
    "In Python, write {s}.", "Write, in Python, {s}.", "I am learning Python. Can you write {s}?",
    "In Python, write {s}, and show a short example of its use.", "In Python, write {s}, with a docstring.",
    "Using only Python's standard library, write {s}.", "In Python, write {s}, and explain how it works.",
    "How would you write {s} in Python?", "In Python, write {s}, with comments.",
    "In Python, with type hints, write {s}.", "I am a beginner in Python. Please write {s}.",
    "Can you show me, in Python, {s}?",
)


UTILITIES = (  # more small programs, asked for in PROGRAM_FORMS; none is one of PROGRAMS word for word
    "a function that renames every .txt file in a folder by adding today's date to its name",
    "a function that returns the largest and the smallest number of a list in one pass",
    "a function that checks whether a year is a leap year", "a function that converts Celsius to Fahrenheit and back",
    "a function that flattens a list of lists", "a function that removes the duplicates from a list, keeping the order",
    "a function that reverses the words of a sentence", "a function that checks whether a string is a palindrome",
    "a function that computes the factorial of a number without recursion",
    "a function that returns the greatest common divisor of two numbers",
    "a function that counts the vowels in a string", "a function that converts a binary string to an integer",
    "a function that returns the second largest number in a list",
    "a function that capitalizes the first letter of every word",
    "a function that reads a text file and returns its ten most common words with their counts",
    "a function that checks whether two strings are anagrams",
    "a function that computes the average of a list of grades",
    "a function that returns a dictionary of word frequencies",
    "a function that converts a list of strings to integers",
    "a function that finds the index of an item with binary search",
    "a function that merges two lists that are already in order into one ordered list",
    "a class for a circle with area and circumference methods",
    "a class for a row of light switches that can be turned on and off",
    "a class for a simple timer with start, stop and elapsed methods",
    "a class for an inventory of items with quantities", "a class for a student with a name and a list of grades",
    "a class for a playlist that can add, remove and shuffle songs",
    "a class for a parking lot that tracks free and taken spaces",
    "a class for a simple calculator with add, subtract, multiply and divide",
    "a class for a linked list with append and print methods",
    "a function that validates a phone number with a regular expression",
    "a function that returns the current time as a string in hours and minutes",
    "a function that copies a file to a backup folder", "a function that deletes the empty lines of a text file",
    "a function that appends a line to a log file with a timestamp",
    "a function that computes compound interest over a number of years",
    "a function that simulates rolling two dice a thousand times and counts the totals",
    "a function that draws a triangle of stars with n rows", "a function that prints the even numbers from 1 to 100",
    "a function that sums the digits of a number", "a function that checks whether a number is an Armstrong number",
    "a function that converts a string to snake_case", "a function that converts a string to camelCase",
    "a function that masks all but the last four digits of a card number",
    "a function that extracts all the numbers from a string",
    "a function that returns the nth row of Pascal's triangle",
    "a function that returns the prime factors of a number",
    "a function that computes the body mass index from weight and height",
    "a function that returns the longest word in a sentence", "a function that counts the sentences in a paragraph",
    "a function that checks whether a list is a palindrome",
    "a function that zips two lists into a list of pairs without using zip",
    "a function that builds a simple histogram of a list of numbers with stars",
    "a function that reads a JSON file and prints its keys",
    "a function that splits a URL into its scheme, host and path",
    "a function that generates all the subsets of a small set",
    "a function that returns all the permutations of a string",
    "a function that converts minutes into a string like 2h 05m",
    "a function that splits a full name into first and last",
    "a function that returns the day of the week for a date",
)


def why_prompts(n: int, seed: int = 0) -> list[dict]:
    """n distinct chat prompts asking why an everyday thing happens (WHY_FACTS x WHY_FORMS), a reproducible
    draw (``eagle-data --source why``)."""
    return pair_prompts(WHY_FACTS, WHY_FORMS, "chat", n, seed, "why prompts")


def program_prompts(n: int, seed: int = 0) -> list[dict]:
    """n distinct code prompts asking for a small program as people ask for one (PROGRAMS x PROGRAM_FORMS), a
    reproducible draw (``eagle-data --source programs``)."""
    return pair_prompts(PROGRAMS, PROGRAM_FORMS, "code", n, seed, "program prompts")


# Plans and lists for an occasion, and opinions asked for (chat), written for the draft's data like the advice
# above: no subject shares a word with docs/unseen_prompts.jsonl's chat subjects or with packing, trips and
# travel (checked in tests/test_workloads.py).
PLAN_OCCASIONS = (
    "a birthday dinner for six friends", "my first week at a new job", "a garage sale on Saturday",
    "a family reunion in the summer", "moving into a new flat", "a bake sale at my son's school",
    "a surprise party for my sister", "a quiet weekend at home", "a board game night", "a small wedding in a garden",
    "the first day of a new school year", "spring cleaning the whole house", "a charity run in the park",
    "a job fair next month", "a retirement party for a colleague", "a children's craft afternoon",
    "a dinner party for my in-laws", "the arrival of a new baby", "a workshop for ten volunteers",
    "a cooking class for beginners", "a neighbourhood clean-up day", "a movie night in the backyard",
    "a visit from my grandparents", "a housewarming party", "a team lunch at the office",
    "a fundraising concert", "the end of the football season", "a sleepover for four children",
    "a month of healthier eating", "a home office in a small room", "the first month with a new kitten",
    "a book club meeting", "a Thanksgiving dinner", "a science fair project", "a yard sale with my neighbours",
    "a week of meals under fifty dollars", "a photography walk in the city", "a quiz night at a pub",
    "a farewell party for a friend who is moving abroad", "a tea party for my grandmother's ninetieth birthday",
    "a first aid kit for the house", "a small vegetable patch in spring", "a week of exercise for a beginner",
    "a garden party", "an open day at a small bakery", "a talent show at school",
    "a Sunday brunch for eight people", "a pumpkin carving evening", "a repair café in the library",
    "a picnic lunch for the office", "my daughter's graduation party", "a weekend of painting the fence",
    "a dinner for a friend who is vegan", "a Christmas market stall", "the first week of learning to swim",
    "a quiet evening routine", "a clothes swap with friends", "a small art exhibition", "a reading corner for children",
    "a puzzle evening with my family",
)
PLAN_FORMS = (
    "Help me plan {s}.", "Make me a checklist for {s}.", "What do I need for {s}?",
    "Can you suggest a few ideas for {s}?", "Give me a to-do list for {s}.", "Write a simple schedule for {s}.",
    "What should I think about when I prepare {s}?", "I am in charge of {s}. Where do I begin?",
    "What are the most important things to get right for {s}?", "Give me a step-by-step plan for {s}.",
    "What could go wrong with {s}, and how do I avoid it?", "List five things to do a week before {s}.",
)
OPINION_CHOICES = (
    "working from home", "buying an electric car", "learning to code after fifty", "living without a car",
    "renting instead of buying a house", "getting a parrot while working full time",
    "reading paper books instead of e-books",
    "cooking every meal at home", "going to university later in life", "using a standing desk",
    "keeping a budget spreadsheet", "switching to a four-day work week", "buying second-hand clothes",
    "learning two languages at once", "having a smartphone at the age of ten", "starting a small online shop",
    "taking a year off before university", "eating breakfast every day", "running a marathon without a coach",
    "moving to the countryside", "joining a gym instead of training outdoors", "writing by hand instead of typing",
    "homeschooling children", "buying a house with friends", "using a password manager", "going vegetarian",
    "changing careers at forty", "having a big wedding", "buying insurance for a phone", "learning to play chess",
    "keeping chickens in the garden", "taking cold showers", "watching the news every day", "owning a fish tank",
    "working night shifts", "living in a tiny house", "buying an expensive mattress", "taking an online course",
    "learning to knit", "sharing a flat with strangers", "drinking coffee in the afternoon",
    "getting a part-time job as a student", "paying off a loan early", "using a paper calendar", "owning two cats",
    "giving children pocket money", "growing tomatoes indoors", "taking naps in the afternoon",
    "leaving social media", "buying a used laptop", "learning to draw as an adult", "cycling to work",
    "meal prepping on Sundays", "playing video games with my kids", "wearing a watch", "buying a robot vacuum",
    "writing a blog", "taking music lessons as an adult", "building my own furniture", "keeping a diary",
)
OPINION_FORMS = (
    "What do you think about {s}?", "What are the pros and cons of {s}?", "Is {s} a good idea?",
    "I am thinking about {s}. What would you advise?", "Give me your honest opinion on {s}.",
    "Should I consider {s}? Help me decide.", "What are the main arguments for and against {s}?",
    "Is {s} worth it?", "My partner is against {s}. Who is right?", "In a few sentences, what do you think of {s}?",
    "What should I know before {s}?", "Who is {s} a good fit for, and who should avoid it?",
)


def plan_prompts(n: int, seed: int = 0) -> list[dict]:
    """n distinct chat prompts asking for a plan or a list for an occasion (PLAN_OCCASIONS x PLAN_FORMS), a
    reproducible draw (``eagle-data --source plans``)."""
    return pair_prompts(PLAN_OCCASIONS, PLAN_FORMS, "chat", n, seed, "plan prompts")


def opinion_prompts(n: int, seed: int = 0) -> list[dict]:
    """n distinct chat prompts asking for an opinion on a choice (OPINION_CHOICES x OPINION_FORMS), a reproducible
    draw (``eagle-data --source opinions``)."""
    return pair_prompts(OPINION_CHOICES, OPINION_FORMS, "chat", n, seed, "opinion prompts")


# Texts to rework, written by the target itself: first it writes everyday texts for the occasions above (an
# email, notes, instructions: ``eagle-data --source writings``), then it is asked to rework each one
# (``--source rewrites --texts DIR``): grounded requests whose text the prompt hands over, as people make them.
WRITING_FORMS = (
    "Write a short email to your team about {s}.", "Write a short email to a friend about {s}.",
    "Write a few notes, as a list, for {s}.", "Write short instructions for the helpers at {s}.",
    "Write a short announcement for {s}.", "Write a text message inviting your cousin to {s}.",
    "Write a short story about {s}.", "Write a short diary entry about {s}.",
    "Write a short letter to the guests of {s}.", "Write a short news item about {s}.",
    "Write a short report on how {s} went.", "Write a note for the fridge about {s}.",
)
REWRITE_FORMS = (
    "Sum up this text in a few sentences:\n\n{s}", "Rewrite this text in a more formal tone:\n\n{s}",
    "Turn this text into a numbered list of its main points:\n\n{s}",
    "Make this text shorter without losing anything important:\n\n{s}",
    "Rewrite this text so that a ten-year-old can follow it:\n\n{s}",
    "Using only what this text says, what is it about, and what should the reader do?\n\n{s}",
    "Write a short reply to this message:\n\n{s}",
    "Give this text a title, then say its main point in one sentence:\n\n{s}",
    "Correct any mistakes in this text and give the corrected version:\n\n{s}",
    "Turn this text into one short paragraph:\n\n{s}",
    "List the people, dates and places this text mentions:\n\n{s}",
    "Rewrite this text as a friendly message:\n\n{s}",
)
SHORTEST_TEXT = 120  # characters: a written text shorter than this, once cut to whole sentences, is not reworked


def writing_prompts(n: int, seed: int = 0) -> list[dict]:
    """n distinct chat prompts asking the target to write an everyday text for an occasion (PLAN_OCCASIONS x
    WRITING_FORMS), a reproducible draw (``eagle-data --source writings``): its answers are the texts that
    ``rewrite_prompts`` hands back to it."""
    return pair_prompts(PLAN_OCCASIONS, WRITING_FORMS, "chat", n, seed, "writing prompts")


def whole_sentences(text: str) -> str:
    """A written answer cut after its last sentence end or line break (an answer stops at a token limit, often
    mid-sentence); "" when none."""
    text = text.strip()
    cut = max(text.rfind(end) for end in (".", "!", "?", "\n"))
    return text[: cut + 1].strip() if cut >= 0 else ""


def rewrite_prompts(texts, n: int, seed: int = 0) -> list[dict]:
    """n distinct grounded prompts asking to rework one of ``texts`` (each cut to whole sentences; those shorter
    than SHORTEST_TEXT left out) in one of REWRITE_FORMS, a reproducible draw (``eagle-data --source rewrites
    --texts DIR``)."""
    kept = tuple(t for t in map(whole_sentences, texts) if len(t) >= SHORTEST_TEXT)
    return pair_prompts(kept, REWRITE_FORMS, "grounded", n, seed, "rewrite prompts")


def utility_prompts(n: int, seed: int = 0) -> list[dict]:
    """n distinct code prompts asking for more small programs (UTILITIES x PROGRAM_FORMS), a reproducible draw
    (``eagle-data --source utilities``)."""
    return pair_prompts(UTILITIES, PROGRAM_FORMS, "code", n, seed, "utility prompts")


def stdlib_prompts(n: int, seed: int = 0, root=None) -> list[dict]:
    """n distinct prompts {"prompt", "kind"} made from the standard library that ships with Python (its
    licence: the PSF License): write a function from its docstring (code), explain or document a function
    from its source (grounded: the answer may quote the prompt), say what a module is for (chat). A
    reproducible draw for one Python version; the data's ``prompts_sha256`` records which."""
    import ast

    check_count(n, "standard-library prompts")
    pool = []
    for module, source, tree in stdlib_modules(root):
        lines = LINE.findall(source)
        doc = ast.get_docstring(tree)
        if doc and len(doc) > 40:
            pool.append(("chat", {"module": module, "doc": first_sentences(doc, 600)}))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc, text = ast.get_docstring(node), source_segment(lines, node)
            if doc and len(doc) > 20:
                pool.append(("code", {"name": node.name, "args": f"({ast.unparse(node.args)})",
                                      "doc": first_sentences(doc)}))
            if text and 80 < len(text) <= SOURCE_CHARS:
                pool.append(("grounded", {"source": text}))

    def make(entry, rng):
        kind, fields = entry
        forms = STDLIB_FORMS[kind]
        return {"prompt": forms[int(rng.integers(len(forms)))].format(**fields), "kind": kind}

    return distinct_draw(pool, n, seed, make, "standard-library prompts")


TEXT_CHARS = 1600  # the longest fixed answer (about 400 tokens): a piece of source cut at line ends, or a docstring
TEXT_QUESTIONS = {
    "source": "Show me part of the source code of the Python module {module}.",
    "module": "What is the Python module {module} for?",
    "function": "What does {module}.{name} do?",
}


def source_pieces(source: str, limit: int = TEXT_CHARS) -> list[str]:
    """A module's source cut at line ends into pieces of at most ``limit`` characters (longer lines dropped)."""
    pieces, current = [], ""
    for line in source.splitlines(keepends=True):
        if len(current) + len(line) > limit and current.strip():
            pieces.append(current.strip("\n"))
            current = ""
        if len(line) <= limit:
            current += line
    return pieces + [current.strip("\n")] if current.strip() else pieces


def stdlib_texts(n: int, seed: int = 0, root=None) -> list[dict]:
    """n distinct conversations {"prompt", "answer", "kind": "text"} whose answer is fixed text from the standard
    library (PSF License): a piece of a module's source for "show me the source of M", a module's docstring for
    "what is M for?", a function's docstring for "what does M.f do?". The target reads each teacher-forced
    (``eagle_train.write_answers`` with one new token): its features on text it did not write, as EAGLE
    trains on fixed conversations."""
    import ast

    check_count(n, "standard-library texts")
    pool = []
    for module, source, tree in stdlib_modules(root):
        pool += [("source", {"module": module}, piece) for piece in source_pieces(source) if len(piece) > 200]
        doc = ast.get_docstring(tree)
        if doc and len(doc) > 80:
            pool.append(("module", {"module": module}, doc[:TEXT_CHARS]))
        for node in ast.walk(tree):
            named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if named and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    pool.append(("function", {"module": module, "name": node.name}, doc[:TEXT_CHARS]))
    return distinct_draw(pool, n, seed, lambda e, rng: {"prompt": TEXT_QUESTIONS[e[0]].format(**e[1]),
                                                       "answer": e[2], "kind": "text"}, "standard-library texts")


WORKLOADS = (
    {"kind": "chat", "prompt": "What are the main differences between a frog and a toad?"},
    {"kind": "chat", "prompt": "How do I take care of a small houseplant?"},
    {"kind": "chat", "prompt": "Why do we have leap years?"},
    {"kind": "chat", "prompt": "Give me some advice for my first job interview."},
    {"kind": "chat", "prompt": "What is the difference between a lake and a pond?"},
    {"kind": "chat", "prompt": "Explain how a refrigerator keeps food cold."},
    {"kind": "code", "prompt": "Write a Python function that returns the square of every number in a list."},
    {"kind": "code", "prompt": "Write a Python function that checks whether a string contains only digits."},
    {"kind": "code", "prompt": "Write a Python function that returns the minimum and maximum of a list."},
    {"kind": "code", "prompt": "Write a Python function that counts the uppercase letters in a string."},
    {"kind": "code", "prompt": "Write a Python function that joins a list of words with commas."},
    {"kind": "code", "prompt": "Write a Python function that returns the last n characters of a string."},
    {"kind": "grounded", "prompt": "Rewrite this paragraph in simpler words:\n\nThe library on Elm Street opened in "
     "1921 with two thousand books donated by local families. In 1968 it moved into a larger brick building "
     "next to the town hall, and in 2005 it added a computer room and a children's reading corner. Today it "
     "lends more than fifty thousand books a year and runs a free reading club every Saturday morning."},
    {"kind": "grounded", "prompt": "Summarize this paragraph in one sentence:\n\nMaria started her bakery in a "
     "small kitchen behind her house. At first she sold only bread to her neighbours, but soon people from "
     "nearby villages came for her apple cakes. After five years she rented a shop on the main square, hired "
     "three bakers, and began delivering fresh bread to two schools every morning."},
    {"kind": "grounded", "prompt": "List every city named in this paragraph:\n\nThe train leaves Vienna at "
     "seven in the morning and reaches Salzburg before ten. From there travellers can change for Munich, "
     "or continue west to Zurich, where the line ends. In summer an extra night train runs from Zurich back "
     "to Vienna, stopping in Innsbruck and Linz."},
    {"kind": "grounded", "prompt": "Rewrite this paragraph as a short list of steps:\n\nTo plant a tree, first "
     "dig a hole twice as wide as its roots. Put the tree in the hole so that the top of the roots is level "
     "with the ground. Fill the hole with soil, press it down gently, and water the tree well. Water it again "
     "every week during its first summer."},
    {"kind": "grounded", "prompt": "Summarize this paragraph:\n\nThe museum's new exhibition shows two hundred "
     "photographs of the city taken between 1900 and 1950. Visitors can see the old harbour, the first "
     "electric trams and the market square before the fire of 1931. The exhibition is open every day except "
     "Monday until the end of March, and entry is free for students."},
    {"kind": "grounded", "prompt": "Extract the dates from this paragraph:\n\nThe bridge was designed in 1887 "
     "and building began on 3 May 1889. A flood stopped the work in the spring of 1890, and the bridge finally "
     "opened on 14 August 1892. It was repaired in 1950 and again in 2011, when new lights were added."},
)


def check_held_out(workloads, prompts) -> None:
    """ValueError when a workload prompt is also a training prompt."""
    seen = {p["prompt"] for p in prompts}
    shared = [w["prompt"] for w in workloads if w["prompt"] in seen]
    if shared:
        raise ValueError(f"{len(shared)} workload prompts are also training prompts, e.g. {shared[0][:60]!r}")


def read_prompts(path) -> list[dict]:
    """A .jsonl file of {"prompt": "...", "kind": "chat|code|grounded"} lines -> their list (one-line errors)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON object ({e.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            raise ValueError(f'{path}:{n}: expected {{"prompt": "...", "kind": "chat|code|grounded"}}')
        if item.get("kind") not in KINDS:
            raise ValueError(f"{path}:{n}: kind must be one of {', '.join(KINDS)}, got {item.get('kind')!r}")
        out.append({"prompt": item["prompt"], "kind": item["kind"]})
    if not out:
        raise ValueError(f"prompt file {path} holds no prompts")
    return out
