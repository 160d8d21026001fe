#!/usr/bin/python3
"""Lists the functions in C++ sources longer than a number of lines, longest first.

    scripts/long_functions.py [--over N] [--fail-over M] [--allow NAME ...] [--exclude PATH ...]
                              [PATH ...]

PATH: files or folders (default: src/ next to this script); folders are searched for .cpp, .cu and
.h files. Prints one line per function over N lines (default 80): its length, file:line and
name. With --fail-over M it exits 1 if any function is over M lines (the LongFunctions test keeps
src/ free of very long functions), except the functions named with --allow (as printed, e.g.
CostModel::predict): known ones still to be split; an allowed function no longer over M is
reported, so that it leaves the list. --exclude leaves out files under the given paths.

A function is a brace block opened outside any other function whose header ends in a parameter
list (and perhaps const, noexcept, override, a trailing return type or a constructor's
initializer list); lambdas and local classes count as part of the function they are in. Its
length is the lines from the header's first line to the closing brace. Comments, strings and
character literals are blanked first, so braces inside them do not count. A brace counter, not a
parser: it needs balanced braces, which code that compiles has (macros aside).
"""

import argparse
import os
import re
import sys

# Keywords whose parenthesis before a brace is not a parameter list.
CONTROL = {"if", "for", "while", "switch", "catch", "do", "else", "try", "return", "sizeof",
           "decltype", "alignof", "noexcept", "requires", "static_assert"}
# A header beginning like this opens a scope that may hold functions.
SCOPE = re.compile(r"^(?:template\s*<.*>\s*)?(?:(?:inline\s+)?namespace\b|extern\s+\"C\"|"
                   r"(?:class|struct|union)\b)", re.S)


def blank(text):
    """Comments, string and character literals replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == 'R' and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or
                                                                     text[i - 1] == "_")):
            k = text.find("(", i + 2)
            delim = ")" + text[i + 2:k] + '"'
            j = text.find(delim, k)
            j = n if j < 0 else j + len(delim)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # a digit separator: 1'000
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + " " * (j - i - 2) + c if j - i >= 2 else " " * (j - i))
            i = j
        elif c == "#" and (i == 0 or text[i - 1] == "\n"):  # a preprocessor line
            j = i
            while True:
                j = text.find("\n", j)
                if j < 0 or text[j - 1] != "\\":
                    break
                j += 1
            j = n if j < 0 else j
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching(text, i):
    """The index of the brace closing the one at i."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1


def strip_parens(header):
    """The header with every balanced parenthesized group replaced by '()'."""
    out, depth = [], 0
    for c in header:
        if c == "(":
            if depth == 0:
                out.append("(")
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                out.append(")")
        elif depth == 0:
            out.append(c)
    return "".join(out)


def function_name(header):
    """The name before the header's parameter list, or None when it is no function header."""
    flat = " ".join(strip_parens(header).split())
    if not flat or SCOPE.match(flat) or "=" in flat.split("(")[0] and "operator" not in flat:
        return None
    # A constructor's initializer list: the signature is what comes before the first lone ':'.
    signature = re.split(r"(?<![:<])\)\s*:(?!:)", flat, maxsplit=1)
    if len(signature) == 2:
        flat = signature[0] + ")"
    m = re.search(r"((?:[A-Za-z_~][\w]*\s*::\s*)*(?:operator\s*[^\s(]+|~?[A-Za-z_]\w*))\s*"
                  r"(?:<[^()]*>)?\s*\(\)\s*(?:const|noexcept|override|final|mutable|&|&&|\s|"
                  r"->\s*[\w:<>,\s*&]+)*$", flat)
    if not m:
        return None
    name = re.sub(r"\s+", "", m.group(1))
    if name.split("::")[-1] in CONTROL:
        return None
    return name


def functions(path):
    """(name, first line, lines) of every function defined in the file."""
    with open(path, encoding="utf-8") as f:
        text = blank(f.read())
    found = []
    header_start = 0
    i = 0
    while i < len(text):
        c = text[i]
        if c in ";}":
            header_start = i + 1
        elif c == "{":
            header = text[header_start:i]
            name = function_name(header)
            # An initializer written with braces inside a constructor's initializer list
            # (x_{1}): part of the header; the body's brace follows ')' or '}'.
            if name is None and re.search(r"\)\s*:", strip_parens(header)) and \
                    re.search(r"[\w>]\s*$", header):
                i = matching(text, i) + 1
                continue
            if name is not None:
                end = matching(text, i)
                offset = len(header) - len(header.lstrip())
                first = text.count("\n", 0, header_start + offset) + 1
                last = text.count("\n", 0, end) + 1
                found.append((name, first, last - first + 1))
                i = end + 1
                header_start = i
                continue
            if SCOPE.match(" ".join(header.split())):
                header_start = i + 1  # look for functions inside
            else:  # an initializer, enum or other block: skip it whole
                i = matching(text, i) + 1
                header_start = i
                continue
        i += 1
    return found


def sources(paths, excluded):
    for path in paths:
        if os.path.isfile(path):
            yield path
            continue
        for root, _, files in os.walk(path):
            for name in sorted(files):
                full = os.path.join(root, name)
                if name.endswith((".cpp", ".h", ".cu")) and \
                        not any(os.path.commonpath([full, e]) == e for e in excluded):
                    yield full


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*")
    parser.add_argument("--over", type=int, default=80, help="list functions over this many lines")
    parser.add_argument("--fail-over", type=int, help="exit 1 if any function is over this")
    parser.add_argument("--allow", action="append", default=[],
                        help="a function still allowed over --fail-over (as printed)")
    parser.add_argument("--exclude", action="append", default=[], help="a path to leave out")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = args.paths or [os.path.join(root, "src")]
    excluded = [os.path.normpath(os.path.abspath(e)) for e in args.exclude]
    rows = []
    for path in sources([os.path.abspath(p) for p in paths], excluded):
        for name, line, length in functions(path):
            if length > args.over:
                rows.append((length, os.path.relpath(path, root), line, name))
    rows.sort(key=lambda r: (-r[0], r[1], r[2]))
    for length, path, line, name in rows:
        print(f"{length:5d}  {path}:{line}  {name}")
    if args.fail_over is not None:
        over = [r for r in rows if r[0] > args.fail_over]
        for name in sorted(set(args.allow) - {r[3] for r in over}):
            print(f"note: {name} is no longer over {args.fail_over} lines: take it off the "
                  f"--allow list", file=sys.stderr)
        worst = [r for r in over if r[3] not in args.allow]
        for length, path, line, name in worst:
            print(f"{path}:{line}: {name} is {length} lines, over {args.fail_over}: split it "
                  f"along its seams", file=sys.stderr)
        if worst:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
