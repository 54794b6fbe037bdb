"""Write the small C problem set of examples/compiled.yaml (deterministic): MultiPL-E's row layout - ``language``,
``tests`` (a test program that closes the function and asserts in ``main``), ``stop_tokens`` - with a chat prompt
whose C block holds the includes and the function's signature, so an instruct model answers with the whole
function in a ```c block (``rlvr.verifiers.assertion_programs.solution_part``).

The problems are this project's own; expected values come from the reference implementations kept here. Held-out
problems are functions never trained on.
"""

import json
import math
import random
from pathlib import Path

SYSTEM = "You write correct, short C functions. Answer with one ```c code block holding the whole function."
HEAD = "#include <assert.h>\n#include <math.h>\n#include <string.h>\n"
# name, signature, description, reference, argument generator, C literal of each argument
SPECS = [
    ("add", "int add(int a, int b)", "returns the sum of a and b", lambda a, b: a + b,
     lambda r: [r.randint(-99, 99), r.randint(-99, 99)]),
    ("is_even", "int is_even(int n)", "returns 1 when n is even, else 0", lambda n: int(n % 2 == 0),
     lambda r: [r.randint(-50, 50)]),
    ("twice", "int twice(int n)", "returns two times n", lambda n: 2 * n, lambda r: [r.randint(-100, 100)]),
    ("abs_diff", "int abs_diff(int a, int b)", "returns the absolute difference of a and b", lambda a, b: abs(a - b),
     lambda r: [r.randint(-30, 30), r.randint(-30, 30)]),
    ("clamp", "int clamp(int x, int lo, int hi)", "returns x limited to the range [lo, hi]",
     lambda x, lo, hi: max(lo, min(hi, x)), lambda r: [r.randint(-20, 20), -5, 5]),
    ("factorial", "long factorial(int n)", "returns n! for 0 <= n <= 15", math.factorial, lambda r: [r.randint(0, 15)]),
    ("fib", "long fib(int n)", "returns the n-th Fibonacci number (fib(0) = 0, fib(1) = 1)",
     lambda n: [0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987][n], lambda r: [r.randint(0, 16)]),
    ("sum_digits", "int sum_digits(int n)", "returns the sum of the decimal digits of n >= 0",
     lambda n: sum(map(int, str(n))), lambda r: [r.randint(0, 99999)]),
    ("gcd", "int gcd(int a, int b)", "returns the greatest common divisor of the positive integers a and b",
     math.gcd, lambda r: [r.randint(1, 60), r.randint(1, 60)]),
    ("count_vowels", "int count_vowels(const char *s)", "returns how many characters of s are vowels (aeiou)",
     lambda s: sum(c in "aeiou" for c in s), lambda r: ["".join(r.choices("aebcdio", k=r.randint(0, 10)))]),
    ("count_char", "int count_char(const char *s, char c)", "returns how many times c occurs in s",
     lambda s, c: s.count(c), lambda r: ["".join(r.choices("abc", k=r.randint(0, 9))), r.choice("abc")]),
    ("is_palindrome", "int is_palindrome(const char *s)", "returns 1 when s reads the same backwards, else 0",
     lambda s: int(s == s[::-1]), lambda r: [r.choice(["abba", "abc", "a", "", "racecar", "ab"])]),
    ("square", "long square(int n)", "returns n times n", lambda n: n * n, lambda r: [r.randint(-999, 999)]),
    ("max3", "int max3(int a, int b, int c)", "returns the largest of a, b and c", max,
     lambda r: [r.randint(-50, 50) for _ in range(3)]),
    ("min3", "int min3(int a, int b, int c)", "returns the smallest of a, b and c", min,
     lambda r: [r.randint(-50, 50) for _ in range(3)]),
    ("sign", "int sign(int n)", "returns -1, 0 or 1: the sign of n", lambda n: (n > 0) - (n < 0),
     lambda r: [r.randint(-9, 9)]),
    ("str_length", "int str_length(const char *s)", "returns the number of characters of s", len,
     lambda r: ["".join(r.choices("xyz ", k=r.randint(0, 12)))]),
    ("celsius_to_f", "double celsius_to_f(double c)", "returns the temperature c (Celsius) in Fahrenheit",
     lambda c: c * 9 / 5 + 32, lambda r: [float(r.randint(-40, 100))]),
    ("cube", "long cube(int n)", "returns n to the third power", lambda n: n ** 3, lambda r: [r.randint(-99, 99)]),
    ("is_leap", "int is_leap(int year)", "returns 1 when year is a leap year of the Gregorian calendar, else 0",
     lambda y: int(y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)),
     lambda r: [r.choice([1900, 2000, 2023, 2024, 2100])]),
    ("count_spaces", "int count_spaces(const char *s)", "returns how many spaces s holds",
     lambda s: s.count(" "), lambda r: [" ".join(r.choices(["a", "bb", "ccc"], k=r.randint(1, 5)))]),
    ("mean2", "double mean2(double a, double b)", "returns the mean of a and b", lambda a, b: (a + b) / 2,
     lambda r: [float(r.randint(-20, 20)), float(r.randint(-20, 20))]),
    ("digits", "int digits(int n)", "returns how many decimal digits n >= 0 has (digits(0) = 1)",
     lambda n: len(str(n)), lambda r: [r.randint(0, 999999)]),
    ("power", "long power(int b, int e)", "returns b raised to the power e >= 0", lambda b, e: b ** e,
     lambda r: [r.randint(-5, 5), r.randint(0, 9)]),
    # held out too (added after the first two seeds of examples/compiled.yaml; the training rows are unchanged)
    ("count_upper", "int count_upper(const char *s)", "returns how many characters of s are upper-case letters",
     lambda s: sum(c.isupper() for c in s), lambda r: ["".join(r.choices("aBcDEf", k=r.randint(0, 10)))]),
    ("sum_to_n", "long sum_to_n(int n)", "returns 1 + 2 + ... + n for n >= 0 (0 when n is 0)",
     lambda n: n * (n + 1) // 2, lambda r: [r.randint(0, 1000)]),
    ("is_prime", "int is_prime(int n)", "returns 1 when n is a prime number, else 0",
     lambda n: int(n > 1 and all(n % d for d in range(2, n))), lambda r: [r.randint(0, 60)]),
    ("reverse_digits", "int reverse_digits(int n)",
     "returns n >= 0 with its decimal digits reversed (reverse_digits(120) = 21)", lambda n: int(str(n)[::-1]),
     lambda r: [r.randint(0, 99999)]),
    ("max2", "int max2(int a, int b)", "returns the larger of a and b", max,
     lambda r: [r.randint(-50, 50), r.randint(-50, 50)]),
    ("is_odd", "int is_odd(int n)", "returns 1 when n is odd, else 0", lambda n: int(n % 2 != 0),
     lambda r: [r.randint(-50, 50)]),
    ("count_digit_chars", "int count_digit_chars(const char *s)",
     "returns how many characters of s are decimal digits", lambda s: sum(c.isdigit() for c in s),
     lambda r: ["".join(r.choices("a1b2c3", k=r.randint(0, 10)))]),
    ("last_digit", "int last_digit(int n)", "returns the last decimal digit of n >= 0", lambda n: n % 10,
     lambda r: [r.randint(0, 99999)]),
    ("avg3", "double avg3(double a, double b, double c)", "returns the mean of a, b and c",
     lambda a, b, c: (a + b + c) / 3, lambda r: [float(r.randint(-30, 30)) for _ in range(3)]),
    ("triangle_area", "double triangle_area(double base, double height)",
     "returns the area of a triangle with that base and height", lambda b, h: b * h / 2,
     lambda r: [float(r.randint(1, 40)), float(r.randint(1, 40))]),
]
EVAL = ("count_spaces", "mean2", "digits", "power", "min3", "cube", "count_upper", "sum_to_n", "is_prime",
        "reverse_digits", "max2", "is_odd", "count_digit_chars", "last_digit", "avg3", "triangle_area")
# a body per function, to check the tests (tests/verifiers/test_compiled_examples.py), never shown to the model
SOLUTIONS = {
    "add": "return a + b;", "is_even": "return n % 2 == 0;", "twice": "return 2 * n;",
    "abs_diff": "return a > b ? a - b : b - a;", "clamp": "return x < lo ? lo : x > hi ? hi : x;",
    "factorial": "long f = 1; for (int i = 2; i <= n; i++) f *= i; return f;",
    "fib": "long a = 0, b = 1; for (int i = 0; i < n; i++) { long t = a + b; a = b; b = t; } return a;",
    "sum_digits": "int s = 0; for (; n > 0; n /= 10) s += n % 10; return s;",
    "gcd": "while (b) { int t = a % b; a = b; b = t; } return a;",
    "count_vowels": "int k = 0; for (; *s; s++) k += strchr(\"aeiou\", *s) != NULL; return k;",
    "count_char": "int k = 0; for (; *s; s++) k += *s == c; return k;",
    "is_palindrome": "int n = strlen(s); for (int i = 0; i < n / 2; i++) if (s[i] != s[n - 1 - i]) return 0; return 1;",
    "square": "return (long)n * n;", "max3": "int m = a > b ? a : b; return m > c ? m : c;",
    "min3": "int m = a < b ? a : b; return m < c ? m : c;", "sign": "return (n > 0) - (n < 0);",
    "str_length": "return strlen(s);", "celsius_to_f": "return c * 9 / 5 + 32;", "cube": "return (long)n * n * n;",
    "is_leap": "return year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);",
    "count_spaces": "int k = 0; for (; *s; s++) k += *s == ' '; return k;", "mean2": "return (a + b) / 2;",
    "digits": "int d = 1; for (; n >= 10; n /= 10) d++; return d;",
    "power": "long r = 1; for (int i = 0; i < e; i++) r *= b; return r;",
    "count_upper": "int k = 0; for (; *s; s++) k += *s >= 'A' && *s <= 'Z'; return k;",
    "sum_to_n": "return (long)n * (n + 1) / 2;",
    "is_prime": "if (n < 2) return 0; for (int d = 2; d * d <= n; d++) if (n % d == 0) return 0; return 1;",
    "reverse_digits": "int r = 0; for (; n > 0; n /= 10) r = r * 10 + n % 10; return r;",
    "max2": "return a > b ? a : b;", "is_odd": "return n % 2 != 0;",
    "count_digit_chars": "int k = 0; for (; *s; s++) k += *s >= '0' && *s <= '9'; return k;",
    "last_digit": "return n % 10;", "avg3": "return (a + b + c) / 3;",
    "triangle_area": "return base * height / 2;",
}


def arg_literal(value, c_type: str) -> str:
    if c_type == "char":
        return f"'{value}'"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def ask(name: str, signature: str, description: str) -> str:
    return f"Write the C function `{name}`: it {description}. Complete it:\n```c\n{HEAD}{signature} {{\n```"


# one worked example before each question (a function no row asks for): the answer's form
EXAMPLE = [{"role": "user", "content": ask("triple", "int triple(int n)", "returns three times n")},
           {"role": "assistant", "content": "```c\nint triple(int n) {\n    return 3 * n;\n}\n```"}]


def row(spec, rng: random.Random) -> dict:
    name, signature, description, reference, draw = spec
    parameters = signature.split("(", 1)[1][:-1].split(",")
    types = [part.replace("const ", "").replace("*", " * ").rsplit(" ", 1)[0].strip() for part in parameters]
    asserts, seen = [], set()
    while len(asserts) < 5:
        args = draw(rng)
        key = json.dumps(args)
        if key in seen and len(seen) < 5:
            continue
        seen.add(key)
        call = f"{name}({', '.join(arg_literal(a, t) for a, t in zip(args, types))})"
        want = reference(*args)
        asserts.append(f"    assert(fabs({call} - {want!r}) < 1e-9);" if isinstance(want, float) else
                       f"    assert({call} == {want});")
    return {"prompt": [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": ask(name, signature,
                                                                                                   description)}],
            "language": "c", "tests": "}\nint main(void) {\n" + "\n".join(asserts) + "\n    return 0;\n}\n",
            "stop_tokens": ["\n}"], "name": name}


def main() -> None:
    rng = random.Random(0)
    out = Path(__file__).resolve().parent / "data"
    rows = [row(spec, rng) for spec in SPECS]
    train = [r for r in rows if r["name"] not in EVAL]
    held_out = [r for r in rows if r["name"] in EVAL]
    for path, part in ((out / "c_train.jsonl", train), (out / "c_eval.jsonl", held_out)):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"{path}: {len(part)} problems")


if __name__ == "__main__":
    main()
