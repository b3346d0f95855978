"""Everyday requests, as people write to a chat assistant: how-to and why questions, differences,
tips, advice, short creative tasks, summaries, explanations for an audience, names and ideas,
plans, small coding tasks and arithmetic word problems. Each kind has its templates; a template's
slots are filled from the word lists of ``request_words.py``.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable, Iterator, Sequence
from string import Formatter

from pcgspec.training import request_words as w
from pcgspec.training.topics import CODE_ERRORS, CODE_FUNCTIONS, CODE_HOWTOS, LANGUAGES, items

SLOTS: dict[str, Sequence] = {
    "task": w.TASKS,
    "why": w.WHYS,
    "pair": w.PAIRS,
    "goal": w.GOALS,
    "event": w.EVENTS,
    "trip": w.TRIPS,
    "meal": w.MEALS,
    "subject": w.SUBJECTS,
    "character": w.CHARACTERS,
    "letter": w.LETTERS,
    "story": w.STORIES,
    "concept": w.CONCEPTS,
    "audience": w.AUDIENCES,
    "nameable": w.NAMEABLES,
    "idea": w.IDEAS,
    "plan": w.PLANS,
    "object": w.OBJECTS,
    "func": items(CODE_FUNCTIONS),
    "howto": items(CODE_HOWTOS),
    "error": items(CODE_ERRORS),
    "lang": LANGUAGES,
    "food": w.FOODS,
    "place": w.PLACES,
    "animal": w.ANIMALS,
    "hobby": w.HOBBIES,
    "job": w.JOBS,
    "closing": w.CLOSINGS,
    "n": w.NUMBERS,
    "sentences": w.SENTENCES,
}
KINDS: dict[str, tuple[str, ...]] = {
    "how-to": (
        "How do I {task}?",
        "What's the best way to {task}?",
        "Can you walk me through how to {task}?",
        "I've never tried to {task}. Where do I start?",
        "What are the steps to {task}?",
        "Is there an easy way to {task}?",
        "How do I {task}? {closing}",
        "I want to {task}. What do I need? {closing}",
    ),
    "why": (
        "Why {why[0]}?",
        "Can you explain why {why[1]}?",
        "I've always wondered why {why[1]}. What's the reason?",
        "What's the science behind why {why[1]}?",
        "My daughter asked me why {why[1]}. How should I explain it to her?",
        "Explain to {audience} why {why[1]}.",
    ),
    "difference": (
        "How is {pair[0]} different from {pair[1]}?",
        "I always mix up {pair[0]} and {pair[1]}. How can I tell them apart?",
        "Can you compare {pair[0]} and {pair[1]} in simple terms?",
        "Are {pair[0]} and {pair[1]} the same thing?",
        "What are the main differences between {pair[0]} and {pair[1]}?",
        "What sets {pair[0]} apart from {pair[1]}? {closing}",
    ),
    "tips": (
        "Give me {n} tips for {goal}.",
        "What are your best tips for {goal}?",
        "Do you have any advice for {goal}?",
        "I need some advice about {goal}. What should I keep in mind?",
        "List {n} things that help with {goal}.",
        "What do people often get wrong about {goal}?",
        "Any tips for {goal}? {closing}",
    ),
    "what-should": (
        "What should I wear to {event}? {closing}",
        "What should I bring to {event}? {closing}",
        "What should I know before going to {event}?",
        "What should I take with me on {trip}? {closing}",
        "Help me make a packing list for {trip}.",
        "I'm going on {trip} next month. What should I plan ahead?",
        "What should I cook for {meal}? {closing}",
        "What should I make for {meal}? Give me a few options.",
    ),
    "creative": (
        "Write a poem about {subject}. {closing}",
        "Write a haiku about {subject}.",
        "Write a limerick about {subject}.",
        "Write a four-line rhyming poem about {subject} for a child.",
        "Write a song verse about {subject}.",
        "Write a very short story about {character}.",
        "Tell me a bedtime story about {character}. {closing}",
        "Write the first paragraph of a story about {character}.",
        "Write a short letter to {letter}.",
        "Help me write an email to {letter}. {closing}",
    ),
    "summary": (
        "Summarize {story} in {sentences}.",
        "Summarize {story} in {sentences} for {audience}.",
        "What happens in {story}? Keep it short.",
        "Tell me the plot of {story} in a few sentences.",
        "Give me a one-paragraph summary of {story}.",
        "Retell {story} for {audience}.",
        "What is the main message of {story}?",
        "Who are the main characters in {story}, and what do they want?",
    ),
    "explain": (
        "Explain {concept} to {audience}.",
        "How would you explain {concept} to {audience}?",
        "Can you explain {concept} in a way that {audience} would understand?",
        "I need to explain {concept} to {audience}. How should I put it?",
        "What is the simplest way to explain {concept}? {closing}",
    ),
    "names-ideas": (
        "Suggest {n} names for {nameable}.",
        "What would be a good name for {nameable}?",
        "Help me come up with a name for {nameable}.",
        "Give me some fun name ideas for {nameable}.",
        "Suggest {n} ideas for {idea}.",
        "What are some creative ideas for {idea}?",
        "Brainstorm {n} ideas for {idea}.",
        "I'm stuck. Can you give me ideas for {idea}? {closing}",
    ),
    "plan": (
        "Help me plan {plan}. {closing}",
        "Make a to-do list for {plan}.",
        "Write a step-by-step plan for {plan}.",
        "Make a checklist for {plan}. {closing}",
        "Can you make a simple schedule for {plan}? {closing}",
    ),
    "code": (
        "Write a {lang} function that {func}.",
        "Can you write a short {lang} script that {func}?",
        "How would I write a function in {lang} that {func}?",
        "How do I {howto} in {lang}?",
        "What is the simplest way to {howto} in {lang}?",
        "Show me how to {howto} in {lang}, with an example.",
        "My {lang} program stops with {error}. What does that usually mean and how do I fix it?",
    ),
    "describe": (
        "Describe the taste of {food} to someone who has never tried it.",
        "What does {food} taste like?",
        "Describe {place} in a few vivid sentences.",
        "Describe {place} as if I were standing there.",
        "How does {object} work? {closing}",
        "Explain how {object} works to {audience}.",
    ),
    "animals": (
        "What do {animal} eat?",
        "How long do {animal} usually live?",
        "Tell me some fun facts about {animal}.",
        "How do {animal} sleep?",
        "Are {animal} smart?",
        "How do {animal} communicate with each other?",
        "Would {animal} make good pets? {closing}",
    ),
    "hobbies-jobs": (
        "How do I get started with {hobby}? {closing}",
        "What equipment do I need for {hobby}?",
        "Is {hobby} hard to learn as an adult?",
        "What are the benefits of {hobby}?",
        "I want to try {hobby}. What should I know first?",
        "What does {job} do all day? {closing}",
        "How do I become {job}? {closing}",
        "What skills does {job} need?",
        "Is being {job} a stressful job?",
    ),
}
ARITHMETIC = "arithmetic"


def sample_requests(rng: random.Random, num: int) -> list[str]:
    """``num`` distinct requests (fewer only if ``20 * num`` draws find no more): a kind, one of
    its templates and each slot's filler drawn uniformly, so the kinds (arithmetic word problems
    included) have about the same share until the smaller ones run out of new requests.
    """
    kinds = [*KINDS, ARITHMETIC]
    found: dict[str, None] = {}
    for _ in range(20 * num):
        if len(found) >= num:
            break
        kind = rng.choice(kinds)
        if kind == ARITHMETIC:
            text = rng.choice(_WORD_PROBLEMS)(rng)
        else:
            template = rng.choice(KINDS[kind])
            text = template.format(**{s: rng.choice(SLOTS[s]) for s in slots(template)})
        found.setdefault(text)
    return list(found)


def all_requests() -> Iterator[str]:
    """Every request the templates can make (arithmetic word problems, which draw numbers,
    aside)."""
    for templates in KINDS.values():
        for template in templates:
            names = slots(template)
            for values in itertools.product(*(SLOTS[s] for s in names)):
                yield template.format(**dict(zip(names, values)))


def slots(template: str) -> list[str]:
    """The slot names of ``template`` (``{pair[0]}`` is slot ``pair``), each once."""
    fields = (f for _, f, _, _ in Formatter().parse(template) if f)
    return list(dict.fromkeys(re.split(r"[\[.]", f)[0] for f in fields))


def _cookies(rng: random.Random) -> str:
    return (
        f"I baked {rng.randint(20, 90)} cookies and want to share them equally among "
        f"{rng.randint(3, 12)} friends. How many does each get, and how many are left?"
    )


def _recipe(rng: random.Random) -> str:
    return (
        f"A recipe for {rng.randint(2, 6)} people needs {rng.randrange(100, 800, 25)} g of "
        f"flour. How much flour do I need for {rng.randint(7, 20)} people?"
    )


def _tip(rng: random.Random) -> str:
    return (
        f"Our dinner bill is {rng.randint(25, 240)} dollars and we want to leave a "
        f"{rng.choice((10, 12, 15, 18, 20))}% tip. How much do we pay in total?"
    )


def _pages(rng: random.Random) -> str:
    return (
        f"If I read {rng.randint(8, 60)} pages a day, how many days will it take me to "
        f"finish a {rng.randint(150, 900)}-page book?"
    )


def _sale(rng: random.Random) -> str:
    off = rng.choice((15, 20, 25, 30, 40, 50))
    return f"A jacket costs {rng.randint(30, 300)} dollars and is {off}% off. What does it cost?"


def _ages(rng: random.Random) -> str:
    younger, gap = rng.randint(4, 40), rng.randint(1, 9)
    return (
        f"My sister is {gap} years older than me, and our ages add up to "
        f"{2 * younger + gap}. How old are we?"
    )


def _carpet(rng: random.Random) -> str:
    return (
        f"My living room is {rng.randint(3, 9)}.{rng.randint(0, 9)} m by {rng.randint(3, 9)} "
        "m. How many square metres of carpet do I need?"
    )


def _change(rng: random.Random) -> str:
    count, price = rng.randint(2, 9), rng.randint(2, 11)
    bill = next(b for b in (20, 50, 100) if b >= count * price)
    return (
        f"I bought {count} notebooks at {price} dollars each and paid with a {bill}-dollar "
        "note. How much change should I get?"
    )


def _movie(rng: random.Random) -> str:
    return (
        f"A film starts at {rng.randint(1, 9)}:{rng.randrange(0, 60, 5):02d} pm and runs for "
        f"{rng.randint(85, 185)} minutes. What time does it end?"
    )


def _fuel(rng: random.Random) -> str:
    return (
        f"My car uses {rng.randint(4, 11)} litres of fuel per 100 km. How much fuel do I "
        f"need for a {rng.randint(40, 900)} km trip?"
    )


def _rent(rng: random.Random) -> str:
    return (
        f"We split a rent of {rng.randrange(900, 4000, 50)} dollars a month among "
        f"{rng.randint(2, 5)} roommates. How much does each of us pay in a year?"
    )


_WORD_PROBLEMS: tuple[Callable[[random.Random], str], ...] = (
    _cookies,
    _recipe,
    _tip,
    _pages,
    _sale,
    _ages,
    _carpet,
    _change,
    _movie,
    _fuel,
    _rent,
)
