"""Regenerate and check the commands, outputs and snippets of passes/README.md (the pass guide).

    .venv/bin/python tests/pass_guide.py            # report what differs (exit 1 if anything does)
    .venv/bin/python tests/pass_guide.py --write    # regenerate the guide's blocks in place

A fenced block of the guide is generated or checked when an HTML comment on the line before
it says how (`tests/test_pass_guide.py` runs the check in CI):

    <!-- guide: output -->          the block's `$ COMMAND` lines are run; the block is those
                                    lines followed by their stdout
    <!-- guide: commands -->        every line is a command that is run; output ignored
    <!-- guide: excerpt FILE | FIRST | LAST [| FIRST | LAST ...] -->
                                    lines of FILE (written by an earlier command) from the
                                    first containing FIRST through the next containing LAST;
                                    several ranges are joined by a `...` line
    <!-- guide: python -->          the block is run as a Python program (it must define
                                    everything it uses); its stdout is kept for
    <!-- guide: stdout -->          the stdout of the last python block
    <!-- guide: excerpt-of PATH -->  checked only: every line (but `...`) occurs in the
                                    repository file PATH, in order

Commands run in this process, as a shell would on a CPU machine (CUDA is hidden): `NAME=VALUE` prefixes set environment
variables, `kiln ARGS` is the `kiln` entry point, `python -c CODE` runs CODE; after a `|`,
`grep [-A N] TEXT` and `head -n N` filter the output (TEXT may start with `^`). Anything else
is refused, so the guide only shows commands this runner can check. Paths under `/tmp/` run
in a scratch directory and are shown as `/tmp/` again. Compared with the guide, hexadecimal
hashes (pass uuids, cache keys) are masked: they change with every edit of a pass, while
the commands, the op counts, the stats and the graph excerpts must not drift silently.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "passes" / "README.md"
MARKER = re.compile(r"^<!-- guide: (?P<kind>[a-z-]+)(?: (?P<arg>.*?))? -->$")
# The guide shows the defaults, whatever the shell running the check has set.
DEFAULT_ENV = {"KILN_ENABLE_PASSES": "", "KILN_CPU_FUSIONS": "", "KILN_DUMP_GRAPHS": ""}
HASH = re.compile(r"\b[0-9a-f]{16}(?:[0-9a-f]{16})?\b")


class GuideError(RuntimeError):
    """A block the runner cannot handle, or a command that failed."""


@dataclass
class Block:
    kind: str
    arg: str
    start: int  # index of the first body line in the guide's lines
    end: int  # index of the closing fence
    body: list[str]
    line_no: int  # of the marker, 1-based, for messages


def parse(text: str) -> list[Block]:
    lines = text.split("\n")
    blocks = []
    for i, line in enumerate(lines):
        m = MARKER.match(line.strip())
        if not m:
            continue
        if i + 1 >= len(lines) or not lines[i + 1].lstrip().startswith("```"):
            raise GuideError(f"passes/README.md:{i + 1}: a guide marker must be followed by a fenced block")
        indent = len(lines[i + 1]) - len(lines[i + 1].lstrip())
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        body = [x[indent:] if x[:indent].strip() == "" else x for x in lines[i + 2:end]]
        blocks.append(Block(m["kind"], (m["arg"] or "").strip(), i + 2, end, body, i + 1))
    return blocks


def mask(text: str) -> str:
    return HASH.sub("<hash>", text)


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ, and no CUDA: the guide shows what a CPU machine (CI) prints,
    and a check on a GPU machine must compare the same thing."""
    import torch

    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    cuda_available = torch.cuda.is_available
    torch.cuda.is_available = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.is_available = cuda_available  # type: ignore[assignment]
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Runner:
    """Runs the guide's commands in a scratch directory standing in for /tmp."""

    def __init__(self, scratch: Path):
        self.scratch = scratch
        self.python_stdout = ""

    def to_scratch(self, text: str) -> str:
        return text.replace("/tmp/", f"{self.scratch}/")

    def from_scratch(self, text: str) -> str:
        return text.replace(f"{self.scratch}/", "/tmp/").replace(str(self.scratch), "/tmp")

    def run(self, command: str) -> str:
        stages = [s.strip() for s in self.to_scratch(command).split(" | ")]
        out = self._program(shlex.split(stages[0]))
        for stage in stages[1:]:
            out = self._filter(shlex.split(stage), out)
        return self.from_scratch(out)

    def _program(self, argv: list[str]) -> str:
        env = dict(DEFAULT_ENV)
        while argv and re.match(r"^[A-Z_]+=", argv[0]):
            name, _, value = argv.pop(0).partition("=")
            env[name] = value
        buf = io.StringIO()
        with environment(env), contextlib.redirect_stdout(buf):
            if argv[:1] == ["kiln"]:
                from kiln.runtime.cli import main

                code = main(argv[1:])
                if code != 0:
                    raise GuideError(f"`{' '.join(argv)}` exited with {code}")
            elif argv[:2] == ["python", "-c"] and len(argv) == 3:
                exec(compile(argv[2], "<guide python -c>", "exec"), {"__name__": "__guide__"})
            else:
                raise GuideError(f"the guide runner does not run {argv[:2]}: only kiln, python -c, grep, head")
        return buf.getvalue()

    @staticmethod
    def _filter(argv: list[str], text: str) -> str:
        lines = text.splitlines()
        if argv[:1] == ["head"] and len(argv) == 3 and argv[1] == "-n":
            return "".join(line + "\n" for line in lines[: int(argv[2])])
        if argv[:1] == ["grep"]:
            options = " ".join(argv[1:-1]).replace(" ", "")
            m = re.fullmatch(r"(?:-A(\d+))?", options)
            if m is None:
                raise GuideError(f"the guide runner's grep takes -A N only, not {options!r}")
            after = int(m[1] or 0)
            pattern = argv[-1]
            hit = (lambda s: s.startswith(pattern[1:])) if pattern.startswith("^") else (lambda s: pattern in s)
            keep: set[int] = set()
            for i, line in enumerate(lines):
                if hit(line):
                    keep.update(range(i, min(len(lines), i + after + 1)))
            return "".join(lines[i] + "\n" for i in sorted(keep))
        raise GuideError(f"the guide runner does not filter through {argv}: only grep [-A N] TEXT and head -n N")

    def python(self, code: str) -> str:
        buf = io.StringIO()
        with environment(DEFAULT_ENV), contextlib.redirect_stdout(buf):
            exec(compile(self.to_scratch(code), "<guide python block>", "exec"), {"__name__": "__guide__"})
        self.python_stdout = self.from_scratch(buf.getvalue())
        return code

    def excerpt(self, arg: str) -> list[str]:
        path, *marks = [part.strip() for part in arg.split(" | ")]
        if not marks or len(marks) % 2:
            raise GuideError(f"excerpt {arg!r}: give FILE | FIRST | LAST (pairs of markers)")
        lines = Path(self.to_scratch(path)).read_text().splitlines()
        out: list[str] = []
        i = 0
        for first, last in zip(marks[::2], marks[1::2]):
            start = next((j for j in range(i, len(lines)) if first in lines[j]), None)
            if start is None:
                raise GuideError(f"excerpt of {path}: no line contains {first!r}")
            stop = next((j for j in range(start, len(lines)) if last in lines[j]), None)
            if stop is None:
                raise GuideError(f"excerpt of {path}: no line after {first!r} contains {last!r}")
            if out:
                out.append("...")
            out += lines[start: stop + 1]
            i = stop + 1
        return out


def _excerpt_of(block: Block) -> list[str]:
    """The block itself if its lines occur in order in the file; else raises."""
    lines = (REPO / block.arg).read_text().splitlines()
    i = 0
    for wanted in block.body:
        if wanted.strip() in ("", "..."):
            continue
        while i < len(lines) and lines[i] != wanted:
            i += 1
        if i == len(lines):
            raise GuideError(f"passes/README.md:{block.line_no}: {wanted!r} is not in {block.arg} (in this order)")
        i += 1
    return block.body


def generate(blocks: list[Block], scratch: Path) -> list[list[str]]:
    """The body each block should have, in order."""
    runner = Runner(scratch)
    bodies = []
    for block in blocks:
        try:
            if block.kind == "output":
                commands = [line[2:] for line in block.body if line.startswith("$ ")]
                if not commands:
                    raise GuideError("an output block starts with `$ COMMAND` lines")
                body = []
                for c in commands:
                    body.append(f"$ {c}")
                    body += [x for x in runner.run(c).rstrip("\n").split("\n") if x or body[-1]]
            elif block.kind == "commands":
                for line in block.body:
                    if line.strip() and not line.startswith("#"):
                        runner.run(line)
                body = block.body
            elif block.kind == "excerpt":
                body = runner.excerpt(block.arg)
            elif block.kind == "python":
                runner.python("\n".join(block.body))
                body = block.body
            elif block.kind == "stdout":
                body = runner.python_stdout.rstrip("\n").split("\n")
            elif block.kind == "excerpt-of":
                body = _excerpt_of(block)
            else:
                raise GuideError(f"unknown guide block kind {block.kind!r}")
        except GuideError as e:
            raise GuideError(f"passes/README.md:{block.line_no}: {e}") from e
        bodies.append(body)
    return bodies


def regenerate(text: str, scratch: Path) -> tuple[str, list[tuple[Block, list[str]]]]:
    """The guide with every generated block replaced, and the blocks that changed (masked)."""
    blocks = parse(text)
    bodies = generate(blocks, scratch)
    lines = text.split("\n")
    changed = []
    for block, body in sorted(zip(blocks, bodies), key=lambda bb: bb[0].start, reverse=True):
        indent = lines[block.start - 1][: len(lines[block.start - 1]) - len(lines[block.start - 1].lstrip())]
        if mask("\n".join(body)) != mask("\n".join(block.body)):
            changed.append((block, body))
        lines[block.start: block.end] = [indent + x if x else x for x in body]
    return "\n".join(lines), sorted(changed, key=lambda bb: bb[0].start)


def main(argv: list[str]) -> int:
    write = "--write" in argv
    text = GUIDE.read_text()
    with tempfile.TemporaryDirectory(prefix="kiln-guide-") as scratch:
        new_text, changed = regenerate(text, Path(scratch))
    if write:
        GUIDE.write_text(new_text)
        print(f"passes/README.md: {len(changed)} block(s) changed beyond hashes; rewritten")
        return 0
    import difflib

    for block, body in changed:
        print(f"passes/README.md:{block.line_no} ({block.kind}) differs:")
        print("\n".join(difflib.unified_diff(block.body, body, "guide", "generated", lineterm="")))
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
