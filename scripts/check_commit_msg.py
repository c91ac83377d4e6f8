#!/usr/bin/env python3
"""A commit message's shape: a subject of 1 to 72 characters, a blank line,
then a body that says why (a merge, or a fixup!/squash!/amend! commit that
autosquash folds away, may go without one; trailers such as Signed-off-by
alone are no body).

    ln -s ../../scripts/check_commit_msg.py .git/hooks/commit-msg   # every commit, as it is made
    scripts/check_commit_msg.py --range origin/main..HEAD           # commits already made
    scripts/check_commit_msg.py MESSAGE_FILE                        # one message (what the hook runs)

As a hook it reads the message before git's clean-up, so it drops what git
would: '#' comment lines and everything below the scissors line (commit -v).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

MAX_SUBJECT = 72
SCISSORS = "# ------------------------ >8 ------------------------"
TRAILER = re.compile(r"[A-Za-z][A-Za-z0-9-]*: \S")  # Signed-off-by: ..., Co-authored-by: ...
NO_BODY_PREFIXES = ("fixup! ", "squash! ", "amend! ")  # `git commit --fixup` and friends: folded by autosquash


def clean(text: str, strip_comments: bool = True) -> list[str]:
    """The message's lines as git keeps them (its default clean-up, `strip`):
    without comment lines and what follows the scissors line when
    strip_comments (a message not yet committed), trailing spaces and
    leading and trailing blank lines."""
    lines = []
    for line in text.splitlines():
        if strip_comments and line == SCISSORS:
            break
        if strip_comments and line.startswith("#"):
            continue
        lines.append(line.rstrip())
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _explains(body: list[str]) -> bool:
    """Whether the body holds a line of prose (not only a closing paragraph of trailers)."""
    paragraphs: list[list[str]] = [[]]
    for line in body:
        if line:
            paragraphs[-1].append(line)
        elif paragraphs[-1]:
            paragraphs.append([])
    paragraphs = [p for p in paragraphs if p]
    if paragraphs and all(TRAILER.match(line) for line in paragraphs[-1]):
        paragraphs.pop()
    return bool(paragraphs)


def problems(text: str, merge: bool = False, strip_comments: bool = True) -> list[str]:
    """What is wrong with a commit message (empty when nothing)."""
    lines = clean(text, strip_comments)
    if not lines:
        return ["the subject is empty"]
    subject, out = lines[0], []
    if len(subject) > MAX_SUBJECT:
        out.append(f"the subject has {len(subject)} characters; at most {MAX_SUBJECT}")
    if len(lines) > 1 and lines[1]:
        out.append("no blank line between the subject and the body")
    if not merge and not subject.startswith(NO_BODY_PREFIXES) and not _explains(lines[1:]):
        out.append("no body: below the subject and a blank line, say why the change is made")
    return out


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def merging() -> bool:
    """Whether the commit being made concludes a merge (the hook's case)."""
    try:
        git_dir = _git("rev-parse", "--git-dir").strip()
    except (OSError, subprocess.CalledProcessError):
        return False
    return os.path.exists(os.path.join(git_dir, "MERGE_HEAD"))


def check_range(rev_range: str) -> list[str]:
    """One line per problem of each commit in rev_range (git log's syntax, e.g. BASE..HEAD)."""
    out = []
    for record in _git("log", "-z", "--format=%H%n%P%n%B", rev_range).split("\0"):
        if not record.strip():
            continue
        sha, parents, message = record.lstrip("\n").split("\n", 2)
        subject = message.split("\n", 1)[0]
        for problem in problems(message, merge=len(parents.split()) > 1, strip_comments=False):
            out.append(f"{sha[:12]} {subject[:50]!r}: {problem}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("message_file", nargs="?", help="a commit message file (the commit-msg hook's argument)")
    parser.add_argument("--range", dest="rev_range", help="check the commits of BASE..HEAD instead")
    args = parser.parse_args(argv)
    if (args.message_file is None) == (args.rev_range is None):
        parser.error("give one of a message file and --range")
    if args.rev_range is not None:
        try:
            found = check_range(args.rev_range)
        except subprocess.CalledProcessError as e:
            print(f"git log {args.rev_range}: {e.stderr.strip()}", file=sys.stderr)
            return 2
        for line in found:
            print(line, file=sys.stderr)
        return 1 if found else 0
    with open(args.message_file, encoding="utf-8", errors="replace") as f:
        found = problems(f.read(), merge=merging())
    if found:
        print("commit message refused (scripts/check_commit_msg.py):", file=sys.stderr)
        for problem in found:
            print(f"  - {problem}", file=sys.stderr)
        print(f"(the message is kept in {args.message_file})", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
