"""Run `kiln` commands each in a process of its own, without each one importing torch again.

A test that runs many short `kiln` commands (`kiln cache ls`, `verify`, ...) spent most of
each one importing torch, transformers and Kiln (`kiln cache ls`: 3.6 s, 0.4 s forked). Here a
server process imports `kiln.runtime.cli` (and with it those libraries) once and does nothing
else (no torch op, no thread); for each command it forks a child that is then what
`python -m kiln.runtime.cli ARGS` would be from that point on: its own process with the
command's environment, stdin from /dev/null, stdout and stderr to files of its own,
`sys.argv` as `-m` sets it, and `sys.exit(main())` at the top level of the interpreter, so an
uncaught exception prints its traceback to the child's stderr and the exit status, atexit
handlers and interpreter shutdown are those of a real run. The parent collects the status
(a signal gives -N, as subprocess does) and the two outputs.

    with CliForkServer() as cli:
        proc = cli.run(["cache", "ls", "--cache-dir", root], env=..., timeout=600)  # a CompletedProcess
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The server: imports, then one JSON request a line on stdin -> one JSON reply a line on stdout.
# The child leaves the loop by returning its request; the module's top level then runs the CLI
# as `python -m kiln.runtime.cli` runs it.
_SERVER = r"""
import json, os, sys
import kiln.runtime.cli
import kiln.runtime.cli.__main__ as _cli_main_module
for _name in kiln.runtime.cli.SUBCOMMAND_MODULES:  # what build_parser imports anyway
    __import__(_name)
import kiln.runtime.llm  # what every generate imports (torch, transformers, the engine)
import gc, threading
assert threading.active_count() == 1, threading.enumerate()  # forking with other threads could deadlock
# The imported objects out of the collector's reach: a child's collections (its shutdown's
# included) would otherwise walk them all, copying every page they sit on (3 s, not 1 s, a
# command on a loaded 2-core machine).
gc.freeze()

def _serve():
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing of the server's own reaches the reply pipe
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in requests:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            replies.close()
            return req
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        replies.write(json.dumps({"returncode": code}) + "\n")
    os._exit(0)

_req = _serve()
# --- the child: from here on, `python -m kiln.runtime.cli ARGS` ---
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.dup2(os.open(_req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
os.dup2(os.open(_req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
sys.stdin = open(0, "r", closefd=False)  # sys.stdout and sys.stderr write to fds 1 and 2, as they are
os.environ.clear()
os.environ.update(_req["env"])
os.chdir(_req["cwd"])
sys.argv = [_cli_main_module.__file__, *_req["args"]]
del _req, _null
sys.exit(kiln.runtime.cli.main())
"""


class CliForkServer:
    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="kiln-cli-fork-"))
        self._n = 0
        self._buffer = b""  # of the replies: read with os.read, so that select sees all that is unread

    def start(self) -> "CliForkServer":
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      bufsize=0)
        if self._reply(timeout=600) is None:  # {"ready": pid}: the imports are done
            self.close()
            raise RuntimeError("the kiln CLI fork server did not start within 600 s")
        return self

    def run(self, args: list[str], env: dict[str, str] | None = None, timeout: float = 600,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        """`subprocess.run([python, -m, kiln.runtime.cli, *args], capture_output=True, text=True, ...)`."""
        assert self._proc is not None and self._proc.poll() is None, "the fork server is not running"
        self._n += 1
        out, err = self._dir / f"{self._n}.out", self._dir / f"{self._n}.err"
        request = {"args": list(args), "env": dict(os.environ if env is None else env), "cwd": cwd or os.getcwd(),
                   "stdout": str(out), "stderr": str(err)}
        self._proc.stdin.write((json.dumps(request) + "\n").encode())
        forked = self._reply(timeout=60)
        if forked is None:
            raise RuntimeError("the kiln CLI fork server did not fork within 60 s")
        pid = forked["pid"]
        reply = self._reply(timeout)
        if reply is None:
            os.kill(pid, signal.SIGKILL)  # as subprocess.run does on a timeout (the server reaps it)
            self._reply(timeout=60)
            raise subprocess.TimeoutExpired(["kiln", *args], timeout)
        return subprocess.CompletedProcess(["kiln", *args], reply["returncode"], out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))

    def _reply(self, timeout: float) -> dict | None:
        """The server's next reply line, or None after `timeout` seconds without one."""
        deadline = time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the kiln CLI fork server died (exit status {self._proc.wait()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.stdin.close()  # the server's loop ends at EOF
                try:
                    self._proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._proc.stdout.close()
            self._proc = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "CliForkServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
