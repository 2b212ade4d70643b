"""Render a client-supplied chat template in a child process: sandboxed, time- and memory-limited.

A chat template is Jinja code. The model's own template is trusted (it came with the
weights) and renders in the server's worker threads; a template a *client* sends is not:
Jinja's sandbox stops it from reaching Python internals, but not from looping for minutes
or building a string of gigabytes, and a thread cannot be stopped. So `kiln serve
--allow-client-chat-template` renders such a template here, in a fresh `python -I` process
that imports nothing but jinja2 (~50 ms to start), under RLIMIT_AS and RLIMIT_CPU, and
the server kills it when its time limit passes. Nothing of the server's state is in that
process, and a crash or a kill there costs one request its answer (a 400), nothing else.

The time limit (`--chat-template-timeout`) is the template's own CPU time, not wall clock
since the spawn. The child runs below the server's priority (CHILD_NICE), so on a busy
server (an engine thread, tokenizers, a compile) it gets a slice of a core: at nice 19 its
start-up alone took seconds of wall clock on the 2-core CI machine, and a wall-clock limit
of 2 s refused a template that renders in a millisecond. So the clock starts when the child
says it is ready (interpreter up, jinja2 imported, limits set), and the parent kills it once
its CPU time since then (from /proc) passes the limit. A host so loaded that the child gets
next to no CPU has a separate, generous wall-clock limit (HOST_BUSY_TIMEOUT_S, start-up and
render each): past it the request gets a 503 to retry, not a 400 blaming the template.

The protocol: argv carries the limits (memory bytes, CPU seconds); the child writes READY
on stdout, then reads one JSON object on stdin and writes one on stdout:

    in:  {"template", "messages", "tools", "add_generation_prompt", "variables", "max_chars"}
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
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
DEFAULT_MEMORY_BYTES = 1 << 30  # address space of the child: plenty for a chat prompt
# Nice 10 weighs about 1/9 of the server's nice-0 threads: they win every contested slice
# (/health stays fast while a template spins), and the child still gets ~10% of a saturated
# core (nice 19 weighs 1/70: ~1.4%, too little for a 2 s CPU limit to pass within a minute).
CHILD_NICE = 10
HOST_BUSY_TIMEOUT_S = 60.0  # wall clock for start-up, and for the render: only a host starving the child hits it
READY = b"ready\n"


@dataclass
class SandboxResult:
    text: str | None = None
    error: str | None = None  # the template failed (its own error, the memory or CPU limit)
    timed_out: bool = False
    host_busy: bool = False  # the child got too little CPU within HOST_BUSY_TIMEOUT_S (the host is overloaded)


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process `pid` (Linux /proc), or None where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3 of stat(5)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tail(stderr: bytes) -> str:
    """The end of the child's stderr, for an error message."""
    return stderr.decode(errors="replace").strip()[-300:]


async def render_in_sandbox(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                            add_generation_prompt: bool, variables: dict[str, Any], timeout: float,
                            max_chars: int, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                            host_busy_timeout: float | None = None) -> SandboxResult:
    """Render `template` in a child process; kill it once it has used `timeout` CPU seconds
    (and give up on it after `host_busy_timeout`, default HOST_BUSY_TIMEOUT_S, of wall clock
    with too little CPU to finish)."""
    if host_busy_timeout is None:
        host_busy_timeout = HOST_BUSY_TIMEOUT_S
    request = json.dumps({"template": template, "messages": messages, "tools": tools,
                          "add_generation_prompt": add_generation_prompt, "variables": variables,
                          "max_chars": max_chars}, ensure_ascii=True).encode()
    # Started through nice(1) where there is one, so that even the interpreter's start-up runs
    # below the server's priority (the child sets its own priority too, in case there is none).
    nice = shutil.which("nice")
    # RLIMIT_CPU (whole seconds, start-up included) is the child's own backstop, a second past ours.
    argv = [*([nice, "-n", str(CHILD_NICE)] if nice else []), sys.executable, "-I", str(SCRIPT),
            str(memory_bytes), str(math.ceil(timeout) + 1)]
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = proc.stdout, proc.stderr  # pipes: asked for above
    rendering: asyncio.Future[tuple[bytes, bytes]] | None = None
    try:
        try:
            ready = await asyncio.wait_for(stdout.readline(), host_busy_timeout) if stdout else b""
        except asyncio.TimeoutError:
            return SandboxResult(host_busy=True)
        if ready != READY:
            err = _tail(await stderr.read()) if stderr else ""
            return SandboxResult(error=f"the renderer did not start ({err or 'no message'})")
        cpu_at_ready = _cpu_seconds(proc.pid)
        loop = asyncio.get_running_loop()
        started = loop.time()
        rendering = asyncio.ensure_future(proc.communicate(request))
        while True:
            cpu_now = _cpu_seconds(proc.pid)
            if cpu_at_ready is None:  # no /proc here: wall clock stands in for CPU time
                used = loop.time() - started
            elif cpu_now is None:  # exited and reaped already: its answer is on the way
                used = 0.0
            else:
                used = cpu_now - cpu_at_ready
            if used >= timeout:
                return SandboxResult(timed_out=True)
            if loop.time() - started >= host_busy_timeout:
                return SandboxResult(host_busy=True)
            done, _ = await asyncio.wait({rendering}, timeout=min(max(timeout - used, 0.01), 0.25))
            if done:
                out, err = rendering.result()
                break
    finally:  # on every way out, a cancelled request's included: no child outlives its request
        if rendering is not None and not rendering.done():
            rendering.cancel()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode == -signal.SIGXCPU:  # its own RLIMIT_CPU: past the limit between two of our looks
        return SandboxResult(timed_out=True)
    try:
        answer = json.loads(out)
    except ValueError:
        # Out of memory (or killed otherwise) before it could answer.
        why = f"exit status {proc.returncode}" + (f": {_tail(err)}" if err else "")
        return SandboxResult(error=f"the renderer stopped ({why})")
    if "error" in answer:
        return SandboxResult(error=str(answer["error"]))
    return SandboxResult(text=str(answer["text"]))


def _environment() -> Any:
    """The same environment transformers renders chat templates in, so templates behave alike."""
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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _render(env: Any, req: dict[str, Any]) -> str:
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

    memory_bytes, cpu_seconds = int(sys.argv[1]), int(sys.argv[2])
    # Lower priority than the server: on a busy machine its event loop gets the CPU first.
    with contextlib.suppress(OSError):  # never above the server's priority (a nice server: keep its own)
        os.setpriority(os.PRIO_PROCESS, 0, max(CHILD_NICE, os.getpriority(os.PRIO_PROCESS, 0)))
    env = _environment()  # jinja2 imported before READY: its start-up is not the template's time
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    sys.stdout.buffer.write(READY)
    sys.stdout.buffer.flush()
    req = json.loads(sys.stdin.buffer.read())
    try:
        answer = {"text": _render(env, req)}
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
