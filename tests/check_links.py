#!/usr/bin/env python3
"""Checks every relative link in the repository's Markdown files: the file it names exists
(inside the repository) and, where the link names an anchor, the target has a heading with that
anchor (GitHub's rule: lower case, punctuation dropped, spaces as hyphens, repeats numbered) or an
<a id="..."> element.
Also checks that README.md stays a front door (at most 12,000 characters).

Usage: check_links.py REPO_ROOT. Prints each broken link as FILE:LINE: message; exits 1 if any.
"""
import os
import re
import subprocess
import sys

LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r'<a\s+(?:id|name)="([^"]+)"')
README_LIMIT = 12000


def markdown_files(root):
    listed = subprocess.run(["git", "-C", root, "ls-files", "-co", "--exclude-standard", "*.md"],
                            capture_output=True, text=True, check=True).stdout.split()
    return [path for path in listed if os.path.exists(os.path.join(root, path))]


def slug(text):
    text = re.sub(r"`([^`]*)`", r"\1", text)            # code spans keep their text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    found, seen, fenced = set(), {}, False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                continue
            found.update(HTML_ANCHOR.findall(line))
            match = HEADING.match(line)
            if not match:
                continue
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path):
    fenced = False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                continue
            for match in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
                yield number, match.group(1)


def problems(root):
    root = os.path.realpath(root)
    cache = {}
    for relative in markdown_files(root):
        source = os.path.join(root, relative)
        for number, target in links(source):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = os.path.realpath(
                os.path.join(os.path.dirname(source), file_part)) if file_part else source
            where = f"{relative}:{number}"
            if not resolved.startswith(root + os.sep) and resolved != root:
                yield f"{where}: {target} points outside the repository"
                continue
            if not os.path.exists(resolved):
                yield f"{where}: {target}: no such file"
                continue
            if anchor and resolved.endswith(".md"):
                if resolved not in cache:
                    cache[resolved] = anchors(resolved)
                if anchor not in cache[resolved]:
                    yield f"{where}: {target}: no heading with anchor #{anchor}"
    size = len(open(os.path.join(root, "README.md"), encoding="utf-8").read())
    if size > README_LIMIT:
        yield f"README.md: {size} characters, more than the front door's {README_LIMIT}"


def main():
    if len(sys.argv) != 2:
        print("usage: check_links.py REPO_ROOT", file=sys.stderr)
        return 2
    found = list(problems(sys.argv[1]))
    for line in found:
        print(line)
    print(f"check_links: {len(found)} broken link(s)" if found else "check_links: all links resolve")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
