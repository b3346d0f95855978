"""The ``repetition`` dataset of ``bench_serving.py``: requests whose answer quotes or edits a
given text or code, written for the benchmark (``serving_datasets.py`` holds the others)."""

from __future__ import annotations

_AVERAGE = """def average(x):
    total = 0
    for v in x:
        total += v
    return total / len(x)"""

_INVENTORY = """def restock(items, minimum):
    low = []
    for name, qty in items.items():
        if qty < minimum:
            low.append(name)
    return sorted(low)"""

_GREETING = """function greet(userName) {
  const hour = new Date().getHours()
  if (hour < 12) {
    return "Good morning, " + userName
  }
  return "Good afternoon, " + userName
}"""

_TEMPS = '''def to_fahrenheit(celsius):
    return celsius * 9 / 5 + 32

def describe(celsius):
    if celsius < 0:
        return "freezing"
    if celsius < 20:
        return "mild"
    return "warm"'''

_CART = """class Cart:
    def __init__(self):
        self.items = []

    def add(self, name, price, quantity=1):
        self.items.append((name, price, quantity))

    def total(self):
        return sum(price * quantity for _, price, quantity in self.items)"""

_LOG = """import sys

def read_errors(path):
    print("reading", path)
    errors = []
    with open(path) as f:
        for line in f:
            print("line:", line)
            if "ERROR" in line:
                errors.append(line.strip())
    print("found", len(errors))
    return errors"""

_SQL = """select c.name, count(o.id) as orders
from customers c
left join orders o on o.customer_id = c.id
where c.country = 'NL'
group by c.name
order by orders desc"""

_CONFIG = """server:
  host: 0.0.0.0
  port: 8080
  workers: 4
logging:
  level: info
  file: /var/log/app.log"""

REPETITION = (
    "Fix the spelling mistakes in this paragraph and change nothing else: Last wensday our "
    "familly went to the musuem in the city center. The exibition about ancient Egypt was "
    "fascinting, and my yunger brother could not stop asking questions about the mummys.",
    "Correct the grammar of this text and keep the wording otherwise: Me and my sister has "
    "been living in this town since five years. Every weekends we goes to the market and buys "
    "fresh vegetables, because they is cheaper than in the supermarket.",
    f"Rename the variable `x` to `values` in this function:\n```python\n{_AVERAGE}\n```",
    f"Add type hints to this Python function:\n```python\n{_INVENTORY}\n```",
    "Convert this list to a markdown table with columns Name, Role and City:\n"
    "- Anna Berg, designer, Oslo\n- Tom Reyes, engineer, Manila\n- Lea Martin, teacher, Lyon\n"
    "- Omar Haddad, nurse, Amman\n- Kenji Sato, chef, Osaka",
    f"Add the missing semicolons to this JavaScript function:\n```js\n{_GREETING}\n```",
    f"Rewrite this code so that every function has a one-line docstring:\n```python\n{_TEMPS}\n```",
    f"Add type hints to every method of this class:\n```python\n{_CART}\n```",
    f"Remove all the print statements from this function and keep the rest as it is:\n"
    f"```python\n{_LOG}\n```",
    f"Rewrite this SQL query with the keywords in upper case:\n```sql\n{_SQL}\n```",
    f"Change the port to 9090 and the logging level to debug in this YAML file:\n```yaml\n"
    f"{_CONFIG}\n```",
    "Turn these notes into a numbered list, one item per line: buy milk and eggs; call the "
    "dentist about Thursday; return the library books; pay the electricity bill; water the "
    "plants on the balcony; email Sara the photos from the trip.",
    "Rewrite this paragraph in the past tense: Maria wakes up at six. She makes coffee, feeds "
    "the cat and checks the weather. Then she walks to the station, where she meets her friend "
    "Jonas, and they take the train to the city together.",
    "Convert this CSV to a JSON array of objects:\nid,product,price\n1,notebook,3.50\n2,pencil,"
    "0.80\n3,backpack,24.00\n4,ruler,1.20\n5,eraser,0.60",
    "Replace the British spellings in this text with American ones: The colour of the theatre's "
    "curtains was chosen to honour the organisation's founder, who favoured a centre stage "
    "that could be analysed from every seat in the neighbourhood hall.",
    "Rename the function `calc` to `monthly_payment` everywhere in this code:\n```python\n"
    "def calc(principal, rate, months):\n    r = rate / 12\n    return principal * r / "
    "(1 - (1 + r) ** -months)\n\nprint(calc(20000, 0.05, 60))\nprint(calc(5000, 0.03, 24))\n```",
    "Convert this Python function to use an f-string instead of string concatenation:\n"
    '```python\ndef label(name, age, city):\n    return "Name: " + name + ", age: " + '
    'str(age) + ", city: " + city\n```',
    "Fix the indentation of this Python code:\n```python\ndef count_vowels(text):\ncount = 0\n"
    "for ch in text.lower():\n        if ch in 'aeiou':\n    count += 1\n  return count\n```",
    "Sort this shopping list alphabetically and keep each item as written: oranges, bread, "
    "yogurt, carrots, apples, pasta, tomatoes, cheese, rice, bananas, spinach, butter.",
    "Put this recipe into a markdown list of ingredients followed by numbered steps: Mix 200 g "
    "flour with 2 eggs and 300 ml milk. Add a pinch of salt. Rest the batter for 20 minutes. "
    "Heat a buttered pan and fry thin pancakes for one minute per side.",
    "Convert the variable names in this JavaScript snippet from camelCase to snake_case:\n"
    "```js\nconst firstName = user.firstName;\nconst lastLogin = user.lastLoginDate;\n"
    "const isActive = lastLogin > cutoffDate;\nconsole.log(firstName, isActive);\n```",
    "Add a comment above each line of this shell script explaining what it does:\n```bash\n"
    "mkdir -p backup\ncp *.txt backup/\ntar -czf backup.tar.gz backup\nrm -r backup\n```",
    "Rewrite this email so it sounds more formal, keeping all the facts: Hey Mark, the report "
    "is gonna be late, sorry! The numbers from sales came in Friday instead of Monday. I'll "
    "send it over by Wednesday noon. Cheers, Priya",
    "Fix the punctuation in this text: its been a long week hasnt it the team finished the "
    "project on time the client was happy and we celebrated with pizza on friday evening",
    "Convert this Python for-loop into a list comprehension:\n```python\nsquares = []\nfor n "
    "in range(1, 21):\n    if n % 3 == 0:\n        squares.append(n * n)\n```",
    "Change every date in this text to the format YYYY-MM-DD: The kickoff is on 3 March 2025, "
    "the first review on 17 April 2025, and the launch on 2 June 2025, with a retrospective "
    "on 30 June 2025.",
    "Convert this table of opening hours to a bulleted list: Monday 9-17, Tuesday 9-17, "
    "Wednesday 9-13, Thursday 9-19, Friday 9-17, Saturday 10-14, Sunday closed.",
    "Replace every use of `var` with `let` or `const`, whichever fits, in this code:\n"
    "```js\nvar total = 0;\nvar prices = [4, 8, 15];\nfor (var i = 0; i < prices.length; i++) "
    "{\n  total += prices[i];\n}\nvar message = 'Total: ' + total;\n```",
    "Capitalize the headings of this markdown document and change nothing else:\n# getting "
    "started\nInstall the package with pip.\n## configuration options\nSet the port in "
    "config.yaml.\n## running the tests\nRun pytest from the project root.",
    "Rewrite this paragraph replacing every 'he' with 'she' and 'his' with 'her': He opened "
    "his laptop, checked his calendar and sighed. He had three meetings before lunch, and his "
    "manager wanted the slides by noon, so he made another coffee.",
    "Add error handling to this Python function so it returns None when the file is missing, "
    "and keep the rest the same:\n```python\ndef first_line(path):\n    with open(path) as f:\n"
    "        return f.readline().strip()\n```",
    "Reformat this address block so each part is on its own line: Jane Doe, Flat 4, 27 Harbour "
    "Road, Brighton, BN1 2AB, United Kingdom, phone +44 1273 555 0199.",
    "Translate the comments in this code from French to English and leave the code alone:\n"
    "```python\n# calcule la moyenne des notes\ndef moyenne(notes):\n    # liste vide: zero\n"
    "    if not notes:\n        return 0\n    return sum(notes) / len(notes)\n```",
    "Change this Python dictionary into valid JSON:\n{'name': 'Lamp', 'price': 19.99, "
    "'in_stock': True, 'colors': ['white', 'black'], 'dimensions': {'height': 45, 'width': 20},"
    " 'discount': None}",
)
