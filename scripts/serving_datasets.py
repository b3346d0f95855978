"""Text datasets of ``bench_serving.py``: single-turn user messages, written for the benchmark.

``chat``: everyday requests as people send them to an assistant (how-to, explanations, advice,
small coding questions, recipes, travel, general health knowledge, emails, a short paragraph to
summarize), 5-60 words each. ``repetition``: requests whose answer quotes or edits a given text
or code (fix spelling, rename a variable, reformat a list, add type hints): the workload where
prompt lookup shines, shown beside ``chat``, never instead of it. ``code``: everyday coding
requests (write a function, fix or explain a given snippet, SQL, shell, regex, a small class),
for a code model and its drafter. ``builtin``: six short prompts for a quick smoke run.
"""

from __future__ import annotations

from serving_code import CODE
from serving_repetition import REPETITION

BUILTIN = (
    "Explain gravity to a child.",
    "Write a haiku about the sea.",
    "List three prime numbers and say why they are prime.",
    "What is 12 times 12?",
    "Describe Paris in two sentences.",
    "Write a Python function that reverses a list.",
)

CHAT = (
    "How can I stop my glasses from fogging up when I wear a face mask?",
    "My tomato plants have yellow leaves at the bottom. Is that a problem, and what should I do?",
    "What does a credit score measure, and how can I raise mine over the next year?",
    "Can you recommend a simple stretching routine I can do at my desk during the workday?",
    "I have chicken thighs, rice, an onion and a can of coconut milk. What can I cook tonight?",
    "Is it safe to refreeze meat that has been thawed in the fridge?",
    "How many days would you suggest for a first visit to Lisbon, and what should I not miss?",
    "What is the difference between a virus and a bacterium, in plain language?",
    "Write a polite email to my landlord asking when the broken heater will be repaired.",
    "How do noise-cancelling headphones actually cancel noise?",
    "In Python, what is the difference between a list and a tuple, and when should I use each?",
    "My sourdough bread comes out dense and flat. What am I probably doing wrong?",
    "How much water should an adult drink in a day? I hear very different numbers.",
    "Give me a simple weekly budget plan for a student living on 900 euros a month.",
    "What is a good way to start running if I have never exercised regularly?",
    "Explain compound interest with a small example using real numbers.",
    "How do I politely decline a wedding invitation from a colleague?",
    "Why do airplanes fly at around 35,000 feet instead of lower?",
    "Write a SQL query that counts orders per customer from a table called orders with a "
    "customer_id column.",
    "What should I look for when buying a used bicycle?",
    "How do I make a basic vinaigrette, and how long does it keep in the fridge?",
    "What is the best way to learn vocabulary in a new language without getting bored?",
    "Summarize this paragraph in one sentence: The town council met on Tuesday to discuss the "
    "new bike lanes. Shop owners worried about losing parking, while parents argued that safer "
    "streets would help children cycle to school. The council agreed to a six-month trial on "
    "two main roads.",
    "What are the early signs of dehydration, and what should I do about them?",
    "Can you explain what a JavaScript promise is with a tiny example?",
    "I get nervous before presentations. What can I do in the five minutes before I speak?",
    "What is the cheapest way to travel between Rome and Florence, and how long does it take?",
    "How do I remove rust from a cast iron pan and season it again?",
    "Write a short thank-you note to a neighbour who watered my plants while I was away.",
    "Why does my phone battery drain faster in cold weather?",
    "What is the difference between git merge and git rebase?",
    "How long should I boil an egg for a runny yolk and a firm white?",
    "What are some good habits for getting better sleep on weeknights?",
    "Explain what inflation is and why prices keep going up over time.",
    "I want to ask my manager for a raise. How should I prepare for the conversation?",
    "What is a good packing list for a weekend at the beach with two small kids?",
    "How do vaccines train the immune system?",
    "Write a bash one-liner that finds all files larger than 100 MB in my home folder.",
    "What is the difference between baking soda and baking powder in a cake recipe?",
    "Is it better to rent or buy a home? What are the main things to consider?",
    "Summarize this in two bullet points: Our team shipped the new login page last week. Error "
    "reports dropped by half, but users on older phones say the page loads slowly. Next sprint "
    "we will compress the images and remove an unused script.",
    "How can I keep cut flowers fresh for longer?",
    "What does it mean when a recipe says to fold in the egg whites?",
    "Recommend three easy houseplants for a dark apartment and say how often to water them.",
    "Why do we get hiccups, and is there a trick that really stops them?",
    "How do I write a regular expression that matches a valid email address in most cases?",
    "I'm visiting Tokyo for the first time in spring. Any tips on transport and etiquette?",
    "What is the difference between an IRA and a 401(k)?",
    "Give me a quick vegetarian lunch idea that I can prepare the night before.",
    "How should I treat a minor kitchen burn at home?",
    "Explain recursion using an example that is not factorial or Fibonacci.",
    "What is a polite way to remind a friend that they still owe me money?",
    "How does a heat pump warm a house in winter when it is cold outside?",
    "Write a short out-of-office email reply for a two-week holiday.",
    "What can I do about a dripping kitchen tap before the plumber comes?",
    "How do I convert a string to a date in Python, for example '2024-03-15'?",
    "What is jet lag, and how can I reduce it after a flight from New York to Paris?",
    "Please summarize: The library will close for renovation from June to August. During this "
    "time, books can be returned at the town hall, and a small reading room will open in the "
    "community centre on weekday afternoons.",
    "How much should I tip at a restaurant in the United States, and does it differ in Canada?",
    "Why is it a bad idea to store passwords in plain text in a database?",
    "Suggest a simple three-day workout plan for someone who only has dumbbells at home.",
    "What is the difference between a latte, a cappuccino and a flat white?",
    "My cat keeps scratching the sofa. How can I teach her to use a scratching post instead?",
    "Explain the difference between RAM and storage to someone buying a laptop.",
    "How do I make fluffy pancakes without buttermilk?",
    "What are the rules for carrying liquids in hand luggage on most flights?",
    "Write a two-sentence message inviting my team to a farewell lunch on Friday.",
    "How does a Docker container differ from a virtual machine?",
    "What should I do if I find a tick attached to my skin after a hike?",
    "Can you explain what an index does in a database and why it speeds up queries?",
    "How do I stop my toddler from waking up at five in the morning?",
    "Suggest a scenic two-day road trip from San Francisco with a stop for the night.",
)

DATASETS: dict[str, tuple[str, ...]] = {
    "chat": CHAT,
    "repetition": REPETITION,
    "code": CODE,
    "builtin": BUILTIN,
}


def load(name: str) -> list[str]:
    """The user messages of dataset ``name``; a ValueError lists the known ones."""
    if name not in DATASETS:
        raise ValueError(f"dataset: unknown {name!r}; known: {', '.join(DATASETS)}")
    return list(DATASETS[name])
