"""A small MultiPL-E-style set written for these tests (not MultiPL-E's data): a few problems in five languages,
each row with MultiPL-E's columns (language, prompt, tests, stop_tokens) plus a canonical and a wrong completion,
and one stdin/stdout problem per language."""

JAVA_HEAD = ("import java.util.*;\nimport java.lang.reflect.*;\nimport org.javatuples.*;\nimport java.security.*;\n"
             "import java.math.*;\nimport java.io.*;\nimport java.util.stream.*;\nclass Problem {\n")

ROWS = {
    "cpp": [
        ("sum_digits",
         ("#include<assert.h>\n#include<bits/stdc++.h>\n// Return the sum of the decimal digits of n >= 0.\n"
         "// >>> sum_digits((123))\n// (6)\nlong sum_digits(long n) {\n"),
         ("}\nint main() {\n    auto candidate = sum_digits;\n    assert(candidate((0)) == (0));\n"
         "    assert(candidate((123)) == (6));\n    assert(candidate((9999)) == (36));\n}\n"),
         "    long s = 0;\n    while (n > 0) { s += n % 10; n /= 10; }\n    return s;\n}",
         "    return n % 10;\n}"),
        ("running_max",
         ("#include<assert.h>\n#include<vector>\n// The running maximum of a vector.\n"
         "std::vector<long> running_max(std::vector<long> xs) {\n"),
         ("}\nint main() {\n    auto candidate = running_max;\n"
         "    assert(candidate((std::vector<long>({1, 3, 2}))) == (std::vector<long>({1, 3, 3})));\n"
         "    assert(candidate((std::vector<long>())) == (std::vector<long>()));\n}\n"),
         ("    std::vector<long> out;\n    for (long x : xs)\n"
          "        out.push_back(out.empty() || x > out.back() ? x : out.back());\n    return out;\n}"),
         "    return xs;\n}"),
        ("quad",  # a helper function in the prompt, linked into both units
         ("#include <assert.h>\n// the prompt's helper\nlong twice(long x) { return 2 * x; }\n// Four times x.\n"
         "long quad(long x) {\n"),
         ("}\nint main() {\n    auto candidate = quad;\n    assert(candidate(3) == 12);\n"
         "    assert(twice(candidate(1)) == 8);\n}\n"),
         "    return twice(twice(x));\n}",
         "    return twice(x);\n}"),
    ],
    "c": [
        ("count_vowels",
         ("#include <assert.h>\n#include <string.h>\n// Count the letters a, e, i, o, u in s.\n"
          "int count_vowels(const char *s) {\n"),
         ("}\nint main() {\n    assert(count_vowels(\"\") == 0);\n    assert(count_vowels(\"banana\") == 3);\n"
         "    assert(count_vowels(\"rhythm\") == 0);\n    return 0;\n}\n"),
         "    int n = 0;\n    for (; *s; s++) n += strchr(\"aeiou\", *s) != NULL;\n    return n;\n}",
         "    return (int)strlen(s) / 2;\n}"),
        ("reverse",  # tests that compare through a library call (strcmp)
         ("#include <assert.h>\n#include <stdlib.h>\n#include <string.h>\n// s reversed, in a new string.\n"
          "char *reverse(const char *s) {\n"),
         ("}\nint main() {\n    assert(strcmp(reverse(\"hello world\"), \"dlrow olleh\") == 0);\n"
          "    assert(strcmp(reverse(\"\"), \"\") == 0);\n    return 0;\n}\n"),
         ("    size_t n = strlen(s);\n    char *r = malloc(n + 1);\n"
          "    for (size_t i = 0; i < n; i++) r[i] = s[n - 1 - i];\n    r[n] = 0;\n    return r;\n}"),
         "    return strdup(s);\n}"),
    ],
    "rust": [
        ("sum_digits",
         ("/// Return the sum of the decimal digits of n >= 0.\n/// >>> sum_digits(123)\n/// 6\n"
         "fn sum_digits(n: isize) -> isize {\n"),
         ("}\n\nfn main() {\n    let candidate = sum_digits;\n    assert_eq!(candidate(0), 0);\n"
         "    assert_eq!(candidate(123), 6);\n    assert_eq!(candidate(9999), 36);\n}\n"),
         "    let (mut n, mut s) = (n, 0);\n    while n > 0 { s += n % 10; n /= 10; }\n    s\n}",
         "    n % 10\n}"),
        ("word_counts",  # a `use` line in the prompt: the tests' crate needs it too
         ("use std::collections::HashMap;\n\n/// How often each word of s occurs.\n"
          "fn word_counts(s: String) -> HashMap<String, isize> {\n"),
         ("}\n\nfn main() {\n    let candidate = word_counts;\n"
          "    assert_eq!(candidate(String::from(\"a b a\")), HashMap::from([(String::from(\"a\"), 2), "
          "(String::from(\"b\"), 1)]));\n    assert_eq!(candidate(String::from(\"\")), HashMap::from([]));\n}\n"),
         ("    let mut counts = HashMap::new();\n"
          "    for w in s.split_whitespace() { *counts.entry(w.to_string()).or_insert(0) += 1; }\n    counts\n}"),
         "    HashMap::new()\n}"),
        ("reverse",  # String equality: a memcmp/bcmp call
         ("/// s reversed.\n/// >>> reverse(String::from(\"ab\"))\n/// String::from(\"ba\")\n"
          "fn reverse(s: String) -> String {\n"),
         ("}\n\nfn main() {\n    let candidate = reverse;\n"
          "    assert_eq!(candidate(String::from(\"hello world\")), String::from(\"dlrow olleh\"));\n"
          "    assert_eq!(candidate(\"abcdefghij\".repeat(20)), \"jihgfedcba\".repeat(20));\n"
          "    assert_eq!(candidate(String::from(\"\")), String::from(\"\"));\n}\n"),
         "    s.chars().rev().collect()\n}",
         "    s\n}"),
    ],
    "java": [
        ("running_max",
         JAVA_HEAD + "    // The running maximum of an array list.\n"
         "    public static ArrayList<Long> runningMax(ArrayList<Long> xs) {\n",
         ("    }\n    public static void main(String[] args) {\n"
         "    assert(runningMax((new ArrayList<Long>(Arrays.asList((long)1l, (long)3l, (long)2l)))).equals("
         "(new ArrayList<Long>(Arrays.asList((long)1l, (long)3l, (long)3l)))));\n"
         "    assert(runningMax((new ArrayList<Long>(Arrays.asList()))).equals("
         "(new ArrayList<Long>(Arrays.asList()))));\n"
         "    }\n\n}\n"),
         ("        ArrayList<Long> out = new ArrayList<>();\n        for (long x : xs) out.add(out.isEmpty() || x > "
         "out.get(out.size() - 1) ? x : out.get(out.size() - 1));\n        return out;\n    }\n"),
         "        return xs;\n    }\n"),
    ],
    "javascript": [
        ("count_vowels",
         "//Count the letters a, e, i, o, u in s.\n//>>> count_vowels(\"banana\")\n//3\nfunction count_vowels(s){\n",
         ("const assert = require('node:assert');\n\n\nfunction test() {\n  let candidate = count_vowels;\n"
         "  assert.deepEqual(candidate(\"\"),0);\n  assert.deepEqual(candidate(\"banana\"),3);\n"
         "  assert.deepEqual(candidate(\"rhythm\"),0);\n}\n\ntest();"),
         "  return [...s].filter(c => \"aeiou\".includes(c)).length;\n}",
         "  return Math.floor(s.length / 2);\n}"),
        ("evens",  # tests that call builtins on the returned value
         "//The even numbers of xs, in order.\n//>>> evens([1, 2, 4])\n//[2, 4]\nfunction evens(xs){\n",
         ("const assert = require('node:assert');\n\n\nfunction test() {\n  let candidate = evens;\n"
          "  assert.ok(candidate([1, 2, 3, 4]).includes(4));\n  assert.ok(Object.is(candidate([1, 3]).length, 0));\n"
          "  assert.ok(JSON.stringify(candidate([6, 7, 8])) === \"[6,8]\");\n"
          "  assert.ok(candidate([2, 5]).every((x) => x % 2 === 0));\n"
          "  assert.ok(candidate([6, 8, 9]).join(\",\") === \"6,8\");\n"
          "  assert.ok(Math.max(...candidate([4, 8, 3])) === 8);\n"
          "  assert.ok(String(candidate([10, 11])[0]).startsWith(\"10\"));\n}\n\ntest();"),
         "  return xs.filter((x) => x % 2 === 0);\n}",
         "  return [1];\n}"),
    ],
}

STOPS = {"cpp": ["\n}"], "c": ["\n}"], "rust": ["\n}"], "java": ["\n    }\n"],
         "javascript": ["\nfunction ", "\n/*", "\n//", "\nconsole.log"]}

# stdin/stdout: read n, then n integers; print their sum and their mean (the mean with 6 decimals)
STDIO_CASES = [("3\n1 2 4\n", "7\n2.333333\n"), ("1\n-5\n", "-5\n-5.000000\n"),
               ("4\n10 20 30 40\n", "100\n25.000000\n")]
STDIO = {
    "c": "#include <stdio.h>\nint main(void) {\n    int n; long s = 0, x;\n    scanf(\"%d\", &n);\n"
         "    for (int i = 0; i < n; i++) { scanf(\"%ld\", &x); s += x; }\n"
         "    printf(\"%ld\\n%.6f\\n\", s, (double)s / n);\n    return 0;\n}\n",
    "cpp": "#include <iostream>\n#include <cstdio>\nint main() {\n    int n; long s = 0, x;\n    std::cin >> n;\n"
           "    for (int i = 0; i < n; i++) { std::cin >> x; s += x; }\n"
           "    std::printf(\"%ld\\n%.6f\\n\", s, (double)s / n);\n}\n",
    "rust": "use std::io::Read;\nfn main() {\n    let mut t = String::new();\n"
            "    std::io::stdin().read_to_string(&mut t).unwrap();\n"
            "    let v: Vec<i64> = t.split_whitespace().map(|w| w.parse().unwrap()).collect();\n"
            "    let s: i64 = v[1..].iter().sum();\n    println!(\"{}\\n{:.6}\", s, s as f64 / v[0] as f64);\n}\n",
    "java": "import java.util.*;\npublic class Main {\n    public static void main(String[] args) {\n"
            "        Scanner in = new Scanner(System.in);\n        int n = in.nextInt();\n        long s = 0;\n"
            "        for (int i = 0; i < n; i++) s += in.nextLong();\n"
            "        System.out.println(s);\n        System.out.printf(\"%.6f%n\", (double) s / n);\n    }\n}\n",
    "javascript": "const v = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\n"
                  "const s = v.slice(1).reduce((a, b) => a + b, 0);\nconsole.log(String(s));\n"
                  "console.log((s / v[0]).toFixed(6));\n",
}
