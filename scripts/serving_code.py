"""The ``code`` dataset of ``bench_serving.py``: everyday coding requests, written for the
benchmark (``serving_datasets.py`` holds the others). Write a function, fix a bug in a given
snippet, explain a short snippet, a SQL query, a shell one-liner, a regex, a small class. Each
request is 5-60 words; a snippet it carries follows on its own lines."""

from __future__ import annotations

_MEDIAN = """def median(values):
    values.sort()
    middle = len(values) / 2
    return values[middle]"""

_COUNTER = """counts = {}
for word in text.split():
    counts[word] += 1"""

_FETCH = """async function loadUser(id) {
  const response = fetch(`/api/users/${id}`);
  return response.json();
}"""

_APPEND = """def add_tag(tag, tags=[]):
    tags.append(tag)
    return tags"""

_LOOP = """for i in range(len(items) - 1):
    print(items[i])"""

_COMPREHENSION = """pairs = {k: v for k, v in zip(keys, values) if v is not None}"""

_AWK = (
    """awk -F, 'NR > 1 { total[$1] += $3 } END { for (k in total) print k, total[k] }' sales.csv"""
)

_SQL = """SELECT department, AVG(salary)
FROM employees
WHERE AVG(salary) > 50000
GROUP BY department;"""

_GO = """func sum(nums []int) int {
    total := 0
    for i := 0; i <= len(nums); i++ {
        total += nums[i]
    }
    return total
}"""

_DECORATOR = """def retry(times):
    def wrap(fn):
        def inner(*args, **kwargs):
            for _ in range(times - 1):
                try:
                    return fn(*args, **kwargs)
                except Exception:
                    pass
            return fn(*args, **kwargs)
        return inner
    return wrap"""

CODE = (
    "Write a Python function that checks whether a string is a palindrome, ignoring case and "
    "spaces.",
    "Write a Python function that merges two sorted lists into one sorted list without using "
    "sort().",
    "Write a JavaScript function that debounces another function by a given number of "
    "milliseconds.",
    "Write a Python function that reads a CSV file and returns the rows as a list of dictionaries.",
    "Write a function in Python that flattens a nested list of any depth.",
    "Write a Python function that returns the k most common words in a text.",
    "Write a TypeScript function that groups an array of objects by a given key.",
    "Write a Python function that validates an IPv4 address without using regular expressions.",
    "Write a C function that reverses a null-terminated string in place.",
    "Write a Python generator that yields the lines of a large file in chunks of 1000.",
    "Write a Rust function that returns the largest element of a slice of integers, or None if "
    "it is empty.",
    "Write a Python class Stack with push, pop, peek and is_empty methods.",
    "Write a small Python class BankAccount with deposit, withdraw and a balance that can never "
    "go negative.",
    "Write a Java class Rectangle with width, height, an area method and a toString method.",
    "Write a Python dataclass for a book with title, author, year and a method that says whether "
    "it is older than 50 years.",
    "Write a SQL query that lists the five products with the highest total sales from tables "
    "products(id, name) and sales(product_id, amount).",
    "Write a SQL query that finds customers who have not placed any order, given tables "
    "customers(id, name) and orders(id, customer_id).",
    "Write a SQL query that returns the second highest salary from an employees table.",
    "Write a shell one-liner that counts the lines of all Python files in a folder and its "
    "subfolders.",
    "Give me a shell command that replaces every occurrence of foo with bar in all .txt files "
    "in the current directory.",
    "Write a shell one-liner that shows the ten largest directories under /var.",
    "Write a regex that matches a date in the format YYYY-MM-DD and explain each part.",
    "Write a regular expression that matches US phone numbers like (555) 123-4567 or 555-123-4567.",
    "Write a regex in Python that extracts all hashtags from a tweet.",
    "Write a Python unittest for a function add(a, b) that covers negative numbers and zero.",
    "Write a Dockerfile for a small Flask app that listens on port 8000.",
    f"Fix the bug in this Python function; it crashes on some inputs:\n{_MEDIAN}",
    f"This Python code raises a KeyError. Fix it:\n{_COUNTER}",
    f"Why does this JavaScript function not return the user? Fix it:\n{_FETCH}",
    f"This function returns tags from earlier calls too. Explain why and fix it:\n{_APPEND}",
    f"This loop skips the last item. Fix it:\n{_LOOP}",
    f"This SQL query fails. What is wrong, and what is the correct version?\n{_SQL}",
    f"This Go function panics with index out of range. Fix it:\n{_GO}",
    f"Explain what this Python line does:\n{_COMPREHENSION}",
    f"Explain this shell command step by step:\n{_AWK}",
    f"Explain what this Python decorator does and how to use it:\n{_DECORATOR}",
)
