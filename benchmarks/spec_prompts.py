"""The prompts of benchmarks/spec_decode.py (and spec_sampled.py): copy-heavy edits of short texts and code,
ordinary questions, the draft model's code prompts and Chinese ones."""
from __future__ import annotations

GREET = '''def greet(name):
    print("Hello, " + name + "!")
    print("Welcome to the team, " + name + ".")
    print("Your desk is on the second floor.")
    print("Lunch is served at noon in the cafeteria.")
    print("Please ask if you have any questions.")
'''
POINT = '''class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def __repr__(self):
        return f"Point({self.x}, {self.y})"

    def add(self, other):
        return Point(self.x + other.x, self.y + other.y)
'''
LIST_FILES = '''import os

def list_files(path):
    files = []
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            files.append(full)
    return files
'''
COUNTER = '''def count_words(text):
    counts = {}
    for word in text.split():
        word = word.lower()
        counts[word] = counts.get(word, 0) + 1
    return counts
'''
COUNCIL = ("The city council met on Tuesday evening to discuss the new budget for the coming year. After a long and "
           "sometimes heated debate, the members agreed to increase funding for public parks, swimming pools and "
           "libraries, while reducing the budget for road repairs and street lighting. The mayor said the decision "
           "reflects what residents asked for in last year's survey, and promised that the roads would not be "
           "forgotten. A final vote on the budget is expected next month, after a public hearing at the town hall.")
BAKERY = ("Our bakery opens every morning at seven o'clock. We bake fresh bread, croissants and muffins each day, "
          "and our coffee is roasted by a small company in the next town. On Saturdays we also sell cakes and pies, "
          "which often sell out before noon. If you would like to order a cake for a birthday or a wedding, please "
          "call us at least three days in advance.")
TRAIN = ("The train to the coast leaves from platform four at half past nine. Passengers should arrive at the "
         "station at least fifteen minutes early, because the doors close two minutes before departure. Tickets "
         "can be bought online or at the machines in the main hall. Bicycles are allowed on the train, but only in "
         "the last carriage, and dogs must be kept on a lead.")
GARDEN = ("To plant tomatoes, choose a sunny spot in the garden and dig a hole about twice as deep as the pot. "
          "Place the plant in the hole, fill it with soil and water it well. Tomatoes need water every day in hot "
          "weather, and a stick next to each plant will help it grow straight. The first fruit is usually ready to "
          "pick about two months after planting.")
# (text, is code, a word to change, its replacement)
TEXTS = [(GREET, True, "greet", "welcome"), (COUNCIL, False, "Tuesday", "Wednesday"),
         (POINT, True, "Point", "Vector"), (BAKERY, False, "seven", "eight"),
         (LIST_FILES, True, "files", "result"), (TRAIN, False, "four", "six"),
         (COUNTER, True, "counts", "totals"), (GARDEN, False, "tomatoes", "peppers")]
TOPICS = ["why the sky is blue", "how a bicycle stays upright", "what a black hole is", "how bread rises",
          "why we need sleep", "how vaccines work", "what causes the seasons", "how a rainbow forms",
          "how to learn a new language", "saving money", "staying focused while studying", "writing a good email",
          "keeping houseplants alive", "running a first marathon", "making friends in a new city",
          "preparing for a job interview"]

# the single section's prompts: SmolLM2-135M copies these (most code edits it rewrites instead)
SINGLE_PROMPTS = [
    f"Change the function name `greet` to `welcome` in this code and show the full updated code.\n\n```python\n"
    f"{GREET}```",
    f"Add a docstring to this class and show the full updated code.\n\n```python\n{POINT}```",
    f"Rewrite the following paragraph, replacing 'Tuesday' with 'Wednesday'. Keep everything else the same.\n\n"
    f"{COUNCIL}",
]
DRAFT_PROMPTS = [
    "Write a Python function `is_prime(n)` that returns True when n is a prime number, with a docstring and type "
    "hints. Reply with the code only.",
    "Complete this Python function. Reply with the code only.\n\n```python\ndef binary_search(items: list[int], "
    "target: int) -> int:\n    \"\"\"Index of target in the sorted list items, or -1 when it is absent.\"\"\"\n```",
]

CHINESE_PROMPTS = ["请用中文解释什么是二分查找，并给出一个简单的例子。", "用中文写一段关于春天的短文，大约一百字。"]


def copy_prompts() -> list[str]:
    """32 copy-heavy prompts: every text under 4 instructions whose answer repeats it (with a small change), ordered
    so that any first n mix the texts and the instructions (the sweep takes the first n)."""
    out = []
    for j in range(4 * len(TEXTS)):
        text, is_code, a, b = TEXTS[j % len(TEXTS)]
        kind = "code" if is_code else "paragraph"
        show = (lambda t: f"```python\n{t}```") if is_code else (lambda t: t)
        typo = text.replace(a, a[:-2] + a[-1] + a[-2], 1)
        out.append([f"Copy the following {kind} exactly, without any changes.\n\n{show(text)}",
                    f"Rewrite the following {kind}, replacing `{a}` with `{b}`. Keep everything else the same.\n\n"
                    f"{show(text)}",
                    f"Here is some {kind}:\n\n{show(text)}\n\nReturn it again with `{a}` changed to `{b}`.",
                    f"Fix the typo in this {kind} and return the full corrected version.\n\n{show(typo)}"]
                   [(j + j // len(TEXTS)) % 4])
    return out


def ordinary_prompts() -> list[str]:
    """32 prompts whose answers do not repeat them."""
    return [t.format(topic) for topic in TOPICS for t in ("Explain {} in a few sentences.", "Give three tips on {}.")]
