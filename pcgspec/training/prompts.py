"""The prompt set: everyday requests as chat users write them (``chat_requests.py``) and built-in
topics x templates (chat questions, instructions, code, maths, prose continuation), optionally
extended by questions the target writes itself about built-in topics and about words of its own
vocabulary; a share goes to the target without the chat template (raw completion), as
``LLM.generate`` sends text.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pcgspec.training.chat_requests import KINDS, sample_requests
from pcgspec.training.topics import (
    CODE_TASKS,
    INSTRUCTIONS,
    LANGUAGES,
    PROSE_OPENINGS,
    TOPICS,
    items,
)

if TYPE_CHECKING:
    from pcgspec.llm import LLM

PROMPTS_FILE = "prompts.jsonl"
CHAT_TEMPLATES = (
    "What is {t}?",
    "Explain {t} to a ten-year-old.",
    "Why is {t} important?",
    "Give me three interesting facts about {t}.",
    "What are the pros and cons of {t}?",
    "Write a short paragraph about {t}.",
    "How would you teach someone about {t}?",
    "What are common misconceptions about {t}?",
    "Write a short poem about {t}.",
    "Describe the history of {t} briefly.",
    "Compare {t} with something from everyday life.",
    "What questions do people often ask about {t}? Answer two of them.",
)
CODE_TEMPLATES = (
    "Write a {lang} function to {task}.",
    "Show how to {task} in {lang}, with a short explanation.",
    "In {lang}, {task}. Add a usage example.",
)
INSTRUCTION_TEMPLATES = (
    "Write a short email to a friend about {t}.",
    "Summarize what you know about {t} in three bullet points.",
    "Create a quiz with three questions about {t}, with answers.",
    "Write a short blog post introduction about {t}.",
)
PROSE_TEMPLATES = (
    "Continue this story: {t}",
    "Write the next paragraph of a story that begins: {t}",
    "Continue the text in the same style: {t}",
)
TOPIC_PROSE_TEMPLATES = (
    "Write the opening paragraph of a novel about {t}.",
    "Continue this story: Nobody in town talked about {t} until that morning.",
)
SELF_TEMPLATES = (
    "Write one question a curious person might ask about {t}. Reply with the question only.",
    "Write one instruction someone could give an assistant about {t}. Reply with it only.",
    "Write one practical 'how do I' question about {t}. Reply with the question only.",
    "Write a request for advice that involves {t}. Reply with the request only.",
    "Write one question a student might ask a teacher about {t}. Reply with the question only.",
    "Write a short creative writing task about {t}. Reply with the task only.",
    "Write one question that compares {t} with something else. Reply with the question only.",
    "Write one 'why' question about {t}. Reply with the question only.",
)
MIN_WORD_LETTERS = 5  # vocabulary words used as topics: whole lowercase words this long at least
# share of each category among the template prompts ("request": everyday chat requests)
MIX = {"request": 0.45, "chat": 0.2, "instruction": 0.1, "code": 0.12, "math": 0.05, "prose": 0.08}


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str  # request, chat, instruction, code, math, prose (or self)
    source: str  # "builtin" or "self" (written by the target)
    chat: bool = True  # False: sent as it is, without the chat template (a raw completion)


def template_prompts(num: int, seed: int) -> list[Prompt]:
    """``num`` prompts from the built-in material, in the ``MIX`` proportions, shuffled; the
    everyday requests take the rest where a topic pool runs out (their arithmetic word problems
    never do).
    """
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    for category, pool in topic_pools().items():
        rng.shuffle(pool)
        prompts += [Prompt(t, category, "builtin") for t in pool[: round(num * MIX[category])]]
    maths = _math_problems(rng, round(num * MIX["math"]))
    prompts += [Prompt(text, "math", "builtin") for text in maths]
    requests = sample_requests(rng, num - len(prompts))
    prompts += [Prompt(text, "request", "builtin") for text in requests]
    rng.shuffle(prompts)
    return prompts


def topic_pools() -> dict[str, list[str]]:
    """Every prompt of the topic-based categories (chat, instruction, code, prose)."""
    topics = items(TOPICS)
    prose = [t.format(t=topic) for topic in topics for t in TOPIC_PROSE_TEMPLATES]
    return {
        "chat": [t.format(t=topic) for topic in topics for t in CHAT_TEMPLATES],
        "instruction": items(INSTRUCTIONS)
        + [t.format(t=topic) for topic in topics for t in INSTRUCTION_TEMPLATES],
        "code": [
            t.format(lang=lang, task=task)
            for task in items(CODE_TASKS)
            for lang in LANGUAGES
            for t in CODE_TEMPLATES
        ],
        "prose": [t.format(t=o) for o in items(PROSE_OPENINGS) for t in PROSE_TEMPLATES] + prose,
    }


def self_written_prompts(llm: LLM, num: int, seed: int, max_tokens: int = 48) -> list[Prompt]:
    """``num`` questions/instructions the target writes (sampled at temperature 0.8), half
    about built-in topics, half about words of its vocabulary; empty or very short answers are
    dropped.
    """
    from pcgspec.sampling_params import SamplingParams

    rng = random.Random(seed + 1)
    pools = (items(TOPICS), vocabulary_words(llm.get_tokenizer()) or items(TOPICS))
    asks = [rng.choice(SELF_TEMPLATES).format(t=rng.choice(pools[i % 2])) for i in range(num)]
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=seed + i)
        for i in range(num)
    ]
    outs = llm.chat([[{"role": "user", "content": a}] for a in asks], params)
    texts = [" ".join(o.outputs[0].text.split()) for o in outs]
    return [Prompt(t, "self", "self") for t in texts if len(t) >= 12]


def vocabulary_words(tokenizer) -> list[str]:
    """Whole lowercase words of the tokenizer's vocabulary (a token that decodes to a space and
    at least ``MIN_WORD_LETTERS`` letters): thousands of topics no list here names.
    """
    words = (tokenizer.decode([i]) for i in range(len(tokenizer)))
    return sorted(
        {
            w[1:]
            for w in words
            if w[:1] == " "
            and w[1:].isalpha()
            and w[1:].islower()
            and len(w) > MIN_WORD_LETTERS
            and w[1:].isascii()
        }
    )


def build_prompts(
    num: int,
    self_fraction: float,
    seed: int,
    llm_factory: Callable[[], LLM] | None,
    raw_fraction: float = 0.0,
) -> list[Prompt]:
    """``num`` prompts, ``self_fraction`` of them written by the target (``llm_factory()``
    builds it; the shortfall of dropped self-written ones is filled from the templates) and
    ``raw_fraction`` of them (of every source) sent without the chat template.
    """
    num_self = round(num * self_fraction)
    written = self_written_prompts(llm_factory(), num_self, seed) if num_self else []
    prompts = template_prompts(num - len(written), seed) + written
    rng = random.Random(seed + 2)
    rng.shuffle(prompts)
    num_raw = round(len(prompts) * raw_fraction)
    return [replace(p, chat=False) if i < num_raw else p for i, p in enumerate(prompts)]


def save_prompts(path: Path, prompts: Sequence[Prompt]) -> None:
    path.write_text("".join(json.dumps(asdict(p)) + "\n" for p in prompts))


def load_prompts(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} in {path.parent}: run the prompts phase first")
    return [Prompt(**json.loads(line)) for line in path.read_text().splitlines() if line]


def describe(prompts: Sequence[Prompt]) -> dict:
    """Counts by source and category, for the shard metadata."""
    return {
        "num_prompts": len(prompts),
        "sources": dict(Counter(p.source for p in prompts)),
        "without_chat_template": sum(not p.chat for p in prompts),
        "categories": dict(Counter(p.category for p in prompts)),
        "builtin": "pcgspec.training.topics: topics x templates; request: "
        f"pcgspec.training.chat_requests, {len(KINDS)} kinds of everyday "
        "requests, templates x word lists; no hub access",
        "self": "written by the target about built-in topics and vocabulary words",
    }


def _math_problems(rng: random.Random, num: int) -> list[str]:
    kinds: list[Callable[[], str]] = [
        lambda: f"What is {rng.randint(12, 999)} times {rng.randint(3, 99)}? Show your work.",
        lambda: (
            f"Solve for x: {rng.randint(2, 12)}x + {rng.randint(1, 50)} = {rng.randint(51, 200)}."
        ),
        lambda: (
            f"A shop sells pens at {rng.randint(2, 9)} dollars each. How much do "
            f"{rng.randint(3, 30)} pens cost? Explain step by step."
        ),
        lambda: f"What is {rng.randint(5, 95)}% of {rng.randint(20, 2000)}?",
        lambda: (
            f"A train travels {rng.randint(60, 600)} km in {rng.randint(2, 8)} hours. "
            "What is its average speed?"
        ),
        lambda: f"Is {rng.randint(50, 5000)} a prime number? Explain how you checked.",
        lambda: (
            f"Find the area and perimeter of a rectangle {rng.randint(2, 40)} cm by "
            f"{rng.randint(2, 40)} cm."
        ),
        lambda: f"Simplify the fraction {rng.randint(2, 60)}/{rng.randint(61, 240)}.",
        lambda: (
            f"If I save {rng.randint(5, 200)} dollars a week, how long until I have "
            f"{rng.randint(500, 10000)} dollars?"
        ),
        lambda: f"What is the sum of the whole numbers from 1 to {rng.randint(10, 500)}?",
    ]
    return [rng.choice(kinds)() for _ in range(num)]
