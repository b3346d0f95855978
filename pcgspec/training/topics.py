"""The built-in material of the prompt set (no hub access needed): topics, tasks and openings
that ``prompts.py`` and ``chat_requests.py`` combine with templates. NOTE: none of the chat
questions of ``scripts/bench_spec.py`` is among them, nor their subjects (the tests check it).
"""

from __future__ import annotations

TOPICS = """
photosynthesis; black holes; the water cycle; volcanoes; earthquakes; plate tectonics; climate
change; the greenhouse effect; renewable energy; solar panels; wind turbines; nuclear power;
electric cars; batteries; the internet; how email works; encryption; passwords; computer
viruses; artificial intelligence; machine learning; neural networks; robots; 3D printing;
smartphones; GPS; satellites; the Moon; Mars; Jupiter; the Sun; stars; galaxies; the Big Bang;
gravity; magnets; electricity; light; sound; rainbows; lightning; clouds; tornadoes;
hurricanes; the ocean; coral reefs; rainforests; deserts; glaciers; rivers; mountains; caves;
islands; dinosaurs; evolution; DNA; cells; bacteria; viruses; vaccines; the immune system; the
heart; the brain; sleep; dreams; memory; exercise; nutrition; vitamins; water; coffee; tea;
chocolate; bread; cheese; pizza; pasta; rice; spices; cooking eggs; baking cakes; vegetarian
food; gardening; tomatoes; houseplants; trees; bees; ants; butterflies; birds; owls; penguins;
dolphins; whales; sharks; octopuses; elephants; lions; wolves; dogs; cats; horses; cows;
chickens; farming; honey; the Roman Empire; ancient Egypt; the pyramids; ancient Greece; the
Olympic Games; the Middle Ages; castles; knights; the Renaissance; the printing press; the
Industrial Revolution; steam engines; trains; airplanes; the first flight; ships; the Titanic;
bridges; skyscrapers; roads; maps; compasses; clocks; calendars; money; banks; saving money;
budgeting; taxes; inflation; the stock market; starting a small business; job applications;
writing a resume; teamwork; leadership; time management; procrastination; public speaking;
learning a new language; reading books; libraries; poetry; novels; fairy tales; myths;
theater; movies; music; the piano; the guitar; drums; singing; painting; drawing; photography;
sculpture; museums; architecture; fashion; recycling; plastic pollution; air pollution;
cities; villages; public transport; bicycles; walking; running; swimming; football; basketball;
tennis; chess; board games; video games; puzzles; mathematics; prime numbers; fractions;
geometry; probability; statistics; algebra; calculus; the number zero; infinity; logic;
philosophy; ethics; happiness; friendship; kindness; honesty; courage; curiosity; creativity;
boredom; stress; meditation; mindfulness; holidays; birthdays; weddings; camping; hiking;
travelling abroad; packing a suitcase; airports; hotels; the seasons; winter; summer; spring;
autumn; snow; rain; weather forecasts; volcanic islands; the Arctic; Antarctica; the Amazon
river; the Sahara; the Himalayas; the Great Wall of China; Venice; Paris; Tokyo; New York;
London; Rome; democracy; elections; laws; courts; human rights; newspapers; social media;
advertising; online shopping; customer service; open source software; databases; spreadsheets;
cloud computing; programming languages; debugging; version control; operating systems; web
browsers; search engines; video calls; remote work; school; homework; exams; teachers;
universities; scholarships; science experiments; the scientific method; microscopes;
telescopes; chemistry; atoms; molecules; acids and bases; metals; glass; paper; wood; cotton;
wool; silk; rubber; oil; coal; natural gas; hydrogen; oxygen; carbon; salt; sugar; milk;
fermentation; yogurt; soup; salads; breakfast; picnics; restaurants; tipping; manners;
languages of the world; writing systems; the alphabet; emoji; humour; jokes; riddles;
superstitions; ghosts stories; detective stories; science fiction; time travel; space
exploration; astronauts; the International Space Station; rockets; comets; asteroids
"""

CODE_TASKS = """
reverse a string; check whether two words are anagrams; count the vowels in a string; find
the largest number in a list; remove duplicates from a list; sort a list of names; merge two
sorted lists; compute a factorial; compute Fibonacci numbers; check whether a number is prime;
list the primes below 100 with a sieve; compute the greatest common divisor; convert Celsius to
Fahrenheit; count word frequencies in a text; read a CSV file and sum a column; parse a JSON
string; validate an email address; flatten a nested list; implement binary search; implement
bubble sort; implement quicksort; implement a stack; implement a queue; implement a linked
list; find the second largest element; rotate an array; transpose a matrix; multiply two
matrices; compute the average of a list; generate a random password; check balanced
parentheses; convert a number to binary; count the lines in a file; find anagrams in a word
list; capitalize every word in a sentence; compute the running sum of a list; find the most
common element; group items by a key; memoize a slow function; retry a function that may fail;
time how long a function takes; implement FizzBuzz; compute the distance between two points;
simulate rolling two dice; implement a simple calculator; compress a string with run-length
encoding; find the longest word in a sentence; check whether two strings are anagrams; convert
a Roman numeral to an integer; implement a binary tree insert; compute the depth of a binary
tree; detect a cycle in a linked list; implement an LRU cache; split a list into chunks; zip
two lists into a dictionary; compute a moving average; format a date; download a web page
"""

CODE_FUNCTIONS = """
returns the number of days between two dates; removes all punctuation from a sentence; counts
how often each letter appears in a text; converts kilometres to miles; finds the longest
common prefix of a list of words; returns the median of a list of numbers; shuffles a deck of
cards; turns a list of names into a comma-separated string; splits a full name into first and
last name; returns every third element of a list; computes the total price of a shopping cart;
converts a time in seconds to hours, minutes and seconds; finds duplicate files by size;
returns the nth prime number; merges two dictionaries; converts a string to title case;
generates a multiplication table; counts the words in a file; finds the smallest missing
positive integer; reverses the order of words in a sentence; rounds a price to the nearest
five cents; sorts a list of people by age; returns the day of the week for a date; converts a
hex colour to RGB; calculates a tip for a restaurant bill; finds the intersection of two lists;
removes empty strings from a list; computes the area of a circle; validates a phone number;
picks a random quote from a list
"""

CODE_HOWTOS = """
read a file line by line; sort a dictionary by value; make an HTTP request; parse command-line
arguments; write a unit test; format a number with two decimals; get the current date and time;
handle an exception; create a class with a constructor; loop over a list with its index; join
a list of strings; remove an item from a list; check if a key is in a dictionary; read a JSON
file; write to a CSV file; generate a random number; convert a string to an integer; find the
length of a string; copy a file; run code in parallel; measure how long some code takes; use a
regular expression to find emails; create a virtual environment; install a package; define a
constant
"""

CODE_ERRORS = """
an IndexError; a KeyError; a TypeError about NoneType; an IndentationError; a
ZeroDivisionError; a stack overflow; a null pointer exception; a segmentation fault; a syntax
error on the last line; an infinite loop; an out-of-memory error; a circular import
"""

LANGUAGES = ("Python", "JavaScript", "C", "Rust", "Go", "Java", "TypeScript", "C++")

INSTRUCTIONS = """
Write a polite email declining a meeting invitation.; Write a short thank-you note to a
teacher.; Summarize the plot of Romeo and Juliet in three sentences.; Give me a packing list for
a weekend camping trip.; Write a shopping list for a week of healthy dinners.; Suggest five names
for a coffee shop.; Write a product description for a reusable water bottle.; Draft a tweet
announcing a new bookshop opening.; Write a short speech for a friend's birthday.; Create a
weekly workout plan for a beginner.; Write a haiku about the ocean.; Write a limerick about a
cat.; Give three tips for sleeping better.; Explain how to change a flat tyre step by step.;
Write a recipe for pancakes.; Plan a one-day tour of Paris.; Write a short cover letter for a
junior developer job.; List the pros and cons of working from home.; Write a job advertisement
for a barista.; Turn this sentence into a formal one: hey, can u send me the report asap?; Write
a short dialogue between a customer and a waiter.; Give me ten quiz questions for a
history class.; Write a motivational message for someone starting a new job.; Write a short story
for children about a brave mouse.;
Suggest a study schedule for a student with exams in two weeks.; Write an apology message for
missing a friend's party.; Explain the rules of tic-tac-toe.; Write a short review of an
imaginary restaurant.; Give me five ideas for a rainy afternoon.; Write instructions for
making a paper airplane.; Write a welcome message for new members of a book club.; Create a
simple budget for a student living alone.; Write a short poem about autumn leaves.; List five
ways to reduce food waste at home.; Write a short news report about a local marathon.; Explain
how to plant a tree.; Write a riddle and give its answer.; Write a bedtime story about a
sleepy dragon.; Give advice to someone learning to cook.
"""

PROSE_OPENINGS = """
The old ferryman crossed the river one last time.; It was raining when the letter
finally arrived.; Nobody in the village had ever seen the door open.; The train stopped in the
middle of the forest and the lights went out.; Maya found a map hidden inside her
grandmother's cookbook.; The robot woke up in an empty museum.; On the first day of summer, the
river turned silver.; The detective looked at the clock and realised it had stopped at
midnight.; Our ship had been drifting for three days when we saw the island.; The market was
crowded, but the man in the blue coat moved through it like a ghost.; Every morning the baker
left one loaf of bread on the windowsill.; The spaceship's computer spoke for the first time
in a hundred years.; Snow had covered the whole city overnight.; The little boat was painted
red and had no name.; She opened the old piano and found a key that did not belong to it.; The
last bus of the night was empty except for a sleeping dog.; In the year 2150, the oceans had
become quiet.; The garden behind the school had been locked for twenty years.; He had
promised to return before the festival began.; The mountain village had only one telephone.;
When the power went out, the whole street came outside.; The scientist stared at the results
and laughed.; A strange bird landed on the kitchen table.; The castle library had a book with
no words in it.; At the edge of the desert there was a small cafe that never closed.; The
twins had never been apart until the summer they turned twelve.; The map showed a river that
did not exist.; The orchestra was about to begin when the conductor disappeared.; The
astronaut looked back at the Earth and made a decision.; It was the quietest day the city had
ever known.
"""


def items(text: str) -> list[str]:
    """``text`` split at ``;`` into stripped, non-empty items (line breaks are spaces)."""
    return [item.strip() for item in " ".join(text.split()).split(";") if item.strip()]
