"""scripts/check_commit_msg.py, the commit-msg hook: messages fed as strings
and files; git is only read (the last commits' messages)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "check_commit_msg.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import check_commit_msg as hook  # noqa: E402

GOOD = "Sampler: ban tokens on the device\n\nThe host float cost a sync a step.\n"


def test_a_subject_a_blank_line_and_a_body_pass():
    assert hook.problems(GOOD) == []


def test_the_subject_may_have_72_characters_not_73():
    assert hook.problems("x" * 72 + "\n\nwhy\n") == []
    assert hook.problems("x" * 73 + "\n\nwhy\n") == ["the subject has 73 characters; at most 72"]


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "   \n\n# Please enter the commit message\n"])
def test_an_empty_subject_is_refused(text):
    assert hook.problems(text) == ["the subject is empty"]


def test_the_body_must_follow_a_blank_line():
    assert hook.problems("Subject\nbody at once\n") == ["no blank line between the subject and the body"]


def test_a_commit_without_a_body_is_refused_unless_a_merge():
    no_body = "no body: below the subject and a blank line, say why the change is made"
    assert hook.problems("Subject only\n") == [no_body]
    assert hook.problems("Subject\n\n\n") == [no_body]
    assert hook.problems("Merge branch 'x'\n", merge=True) == []
    # fixup!/squash!/amend! commits are folded into their target by autosquash
    assert hook.problems("fixup! Subject\n") == []


def test_trailers_alone_are_no_body_but_may_close_one():
    assert hook.problems("Subject\n\nSigned-off-by: A <a@b.c>\n") != []
    assert hook.problems("Subject\n\nWhy it matters: the host float cost a sync.\n") == []  # prose, not a trailer
    assert hook.problems("Subject\n\nWhy it is done.\n\nSigned-off-by: A <a@b.c>\nCo-authored-by: B <b@c.d>\n") == []


def test_comments_and_the_scissors_section_are_dropped_as_git_drops_them():
    editor = (
        "Subject\n# Please enter the commit message\n\nWhy.\n" + hook.SCISSORS + "\ndiff --git a/x b/x\n+" + "y" * 99
    )
    assert hook.problems(editor) == []
    assert hook.problems("Subject\n\n" + hook.SCISSORS + "\nWhy, below the cut.\n") != []
    # a committed message keeps its '#' lines (--range reads those)
    assert hook.problems("Subject\n\n#123 is fixed\n", strip_comments=False) == []


def test_several_problems_are_named_together():
    assert hook.problems("y" * 80 + "\nno blank line\n") == [
        "the subject has 80 characters; at most 72",
        "no blank line between the subject and the body",
    ]


def test_as_the_hook_it_reads_the_message_file_and_exits_1_naming_the_problem(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text(GOOD)
    bad.write_text("z" * 100 + "\n")
    ok = subprocess.run([sys.executable, SCRIPT, str(good)], capture_output=True, text=True, cwd=tmp_path)
    assert ok.returncode == 0 and ok.stderr == ""
    refused = subprocess.run([sys.executable, SCRIPT, str(bad)], capture_output=True, text=True, cwd=tmp_path)
    assert refused.returncode == 1
    assert "the subject has 100 characters; at most 72" in refused.stderr and "no body" in refused.stderr


# The twelve commits before the hook: their messages are the shape it asks for.
BASE, HEAD = "ed8ed3c94bc5f1910ef17379279f6ccd80204ff8", "b1c32232495f87d5f5c5fcb9bdb25701929e4555"


def test_the_repositorys_commits_before_the_hook_pass(monkeypatch):
    monkeypatch.chdir(ROOT)
    for sha in (BASE, HEAD):
        known = subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], capture_output=True)
        if known.returncode != 0:
            pytest.skip("not a git checkout with these commits (a shallow clone, or a source tarball)")
    commits = subprocess.run(["git", "rev-list", f"{BASE}..{HEAD}"], capture_output=True, text=True).stdout.split()
    assert len(commits) == 12
    assert hook.check_range(f"{BASE}..{HEAD}") == []
