"""passes/README.md cannot drift from the code: every generated block is regenerated here
(its commands run, its dump excerpts re-read, its Python snippets executed) and must equal
what the guide shows, pass uuids and cache keys aside. See tests/pass_guide.py."""

from __future__ import annotations

import difflib

import pytest
from pass_guide import GUIDE, GuideError, Runner, mask, parse, regenerate


def test_the_guide_is_what_kiln_prints(tmp_path) -> None:
    text = GUIDE.read_text()
    kinds = [b.kind for b in parse(text)]
    # The guide's checked blocks: the listing, the dumps, the snippets, the cache miss, §9.
    assert kinds.count("output") >= 5 and kinds.count("excerpt") >= 6 and kinds.count("python") >= 4
    _, changed = regenerate(text, tmp_path)
    report = []
    for block, body in changed:
        diff = difflib.unified_diff(mask("\n".join(block.body)).split("\n"), mask("\n".join(body)).split("\n"),
                                    "passes/README.md", "generated", lineterm="")
        report.append(f"passes/README.md:{block.line_no} ({block.kind} block):\n" + "\n".join(diff))
    assert not report, ("the pass guide differs from what Kiln prints now; regenerate it with "
                        "`.venv/bin/python tests/pass_guide.py --write` and review the diff:\n\n" + "\n\n".join(report))


def test_the_runner_refuses_what_it_cannot_check(tmp_path) -> None:
    runner = Runner(tmp_path)
    with pytest.raises(GuideError, match="does not run"):
        runner.run("pip install something")
    with pytest.raises(GuideError, match="does not filter"):
        runner.run("kiln passes list | sort")
    assert runner.run("kiln passes list | grep -A1 ^phase").startswith("phase      name")
    assert mask("uuid 0123456789abcdef key graph-0123456789abcdef0123456789abcdef") == "uuid <hash> key graph-<hash>"
