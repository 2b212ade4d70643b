"""Render a client-supplied chat template in a child process: sandboxed, time- and memory-limited.

A chat template is Jinja code. The model's own template is trusted (it came with the
weights) and renders in the server's worker threads; a template a *client* sends is not:
Jinja's sandbox stops it from reaching Python internals, but not from looping for minutes
or building a string of gigabytes, and a thread cannot be stopped. So `kiln serve
--allow-client-chat-template` renders such a template here, in a fresh `python -I` process
that imports nothing but jinja2 (~50 ms to start), under RLIMIT_AS and RLIMIT_CPU, and
the server kills it when its wall-clock limit passes. Nothing of the server's state is in
that process, and a crash or a kill there costs one request its answer (a 400), nothing else.

The protocol is one JSON object on stdin and one on stdout:

    in:  {"template", "messages", "tools", "add_generation_prompt", "variables", "max_chars",
          "memory_bytes", "cpu_seconds"}
    out: {"text": ...} or {"error": ...}

This file runs as a script by path (never `-m kiln...`, which would import the runtime and
torch), so it imports only the standard library and jinja2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
DEFAULT_MEMORY_BYTES = 1 << 30  # address space of the child: plenty for a chat prompt


@dataclass
class SandboxResult:
    text: str | None = None
    error: str | None = None  # the template failed (its own error, the memory or CPU limit)
    timed_out: bool = False


async def render_in_sandbox(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                            add_generation_prompt: bool, variables: dict[str, Any], timeout: float,
                            max_chars: int, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> SandboxResult:
    """Render `template` in a child process; kill it after `timeout` seconds (wall clock)."""
    request = json.dumps({"template": template, "messages": messages, "tools": tools,
                          "add_generation_prompt": add_generation_prompt, "variables": variables,
                          "max_chars": max_chars, "memory_bytes": memory_bytes,
                          "cpu_seconds": max(1, math.ceil(timeout))}, ensure_ascii=True).encode()
    # Started through nice(1) where there is one, so that even the interpreter's start-up runs
    # below the server's priority (the child lowers itself too, in case there is none).
    nice = shutil.which("nice")
    argv = [*([nice, "-n", "19"] if nice else []), sys.executable, "-I", str(SCRIPT)]
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(request), timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError) as e:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        if isinstance(e, asyncio.CancelledError):
            raise
        return SandboxResult(timed_out=True)
    try:
        answer = json.loads(out)
    except ValueError:
        # Killed by RLIMIT_CPU (SIGXCPU) or out of memory before it could answer.
        why = f"exit status {proc.returncode}" + (f": {err.decode(errors='replace').strip()[-300:]}" if err else "")
        return SandboxResult(error=f"the renderer stopped ({why})")
    if "error" in answer:
        return SandboxResult(error=str(answer["error"]))
    return SandboxResult(text=str(answer["text"]))


def _render(req: dict[str, Any]) -> str:
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    # The same environment transformers renders chat templates in, so templates behave alike.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    compiled = env.from_string(req["template"])
    variables = dict(req.get("variables") or {})
    variables.update(messages=req["messages"], tools=req.get("tools"),
                     add_generation_prompt=bool(req.get("add_generation_prompt")))
    max_chars = int(req["max_chars"])
    pieces: list[str] = []
    size = 0
    for piece in compiled.generate(**variables):  # stop as soon as the output is too long
        size += len(piece)
        if size > max_chars:
            raise ValueError(f"the template's output is over {max_chars} characters (the prompt limit)")
        pieces.append(piece)
    return "".join(pieces)


def main() -> int:
    import resource

    req = json.loads(sys.stdin.buffer.read())
    # Lower priority than the server: on a busy machine its event loop gets the CPU first.
    with contextlib.suppress(OSError):
        os.nice(19)
    resource.setrlimit(resource.RLIMIT_AS, (int(req["memory_bytes"]), int(req["memory_bytes"])))
    resource.setrlimit(resource.RLIMIT_CPU, (int(req["cpu_seconds"]), int(req["cpu_seconds"]) + 1))
    try:
        answer = {"text": _render(req)}
    except MemoryError:
        answer = {"error": "the template ran out of memory (its renderer may use 1 GiB)"}
    except RecursionError:
        answer = {"error": "the template recursed too deeply"}
    except Exception as e:  # the template's own error (syntax, raise_exception, sandbox refusal)
        answer = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(answer, ensure_ascii=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
