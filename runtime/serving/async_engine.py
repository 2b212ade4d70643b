"""`AsyncLLMEngine`: the engine driven by one background thread, for the async server.

One thread owns the `LLMEngine` and is the only one that touches it: it takes commands
(add, abort, stop) from a queue between steps, runs `step()` while anything is unfinished,
and hands each step's outputs to the event loop. Every request being served shares those
steps, so requests from many clients are batched together (continuous batching), and the
event loop never waits on the model.

Each request gets a `RequestStream`. Outputs are cumulative (each one holds everything
generated so far), so a stream keeps only the latest: a slow reader skips intermediate
states instead of queueing them without bound. (Hence readers use the cumulative fields,
`text`, `token_ids`, `logprobs`, never the per-output `*_delta` ones.)

Faults stay with the request that hit them: `add_request` reports a bad request to its
caller alone, and a `step()` that raises fails the requests it was running (with
`EngineStepError`) while the engine goes on serving the others and new ones.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from kiln.runtime.engine import LLMEngine
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.tp_worker import WorkerFailedError

logger = logging.getLogger("kiln.runtime.serving.async_engine")

# How long the engine thread sleeps when idle before re-checking for commands; a command
# wakes it at once, so this only bounds how stale the idle stats can get.
IDLE_POLL_S = 0.5


class EngineStepError(RuntimeError):
    """The engine step that was running this request failed; the request was aborted."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting to start; the caller should retry later."""

    def __init__(self, num_waiting: int, limit: int):
        super().__init__(f"the server is busy: {num_waiting} requests are waiting to start "
                         f"(limit {limit}); retry later")
        self.num_waiting = num_waiting
        self.limit = limit


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or its thread died) and takes no new requests."""


@dataclass
class EngineSnapshot:
    """A snapshot of the engine's state, refreshed by the engine thread after every step."""

    num_waiting_seqs: int = 0
    num_running_seqs: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found there
    num_steps: int = 0
    num_preemptions: int = 0
    num_step_failures: int = 0
    num_guided_requests: int = 0


class RequestStream:
    """The outputs of one engine request, as the event loop sees them."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._changed = asyncio.Event()
        self.finished = False
        self.first_output_time: float | None = None

    def _put(self, output: RequestOutput) -> None:
        if self.finished:
            return
        if self.first_output_time is None:
            self.first_output_time = time.monotonic()
        self._latest = output
        self.finished = output.finished
        self._changed.set()

    def _fail(self, error: BaseException) -> None:
        if self.finished:
            return
        self._error = error
        self.finished = True
        self._changed.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Yield the latest output each time it changes, ending with the finished one.

        Raises the request's error (EngineStepError, EngineStoppedError) if it failed.
        """
        while True:
            await self._changed.wait()
            self._changed.clear()
            if self._error is not None:
                raise self._error
            if self._latest is not None:
                yield self._latest
                if self._latest.finished:
                    return

    async def result(self) -> RequestOutput:
        last = None
        async for out in self:
            last = out
        if last is None:  # cannot happen: iteration ends only after a finished output
            raise EngineStoppedError(f"request {self.request_id} ended without output")
        return last


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 1024):
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.grammars = engine.grammars  # compiled off the engine thread, masked by the engine
        self.stats = EngineSnapshot()

        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # event-loop side
        self._not_started: set[str] = set()  # event-loop side: queued, no output yet
        self._live: set[str] = set()  # engine-thread side: requests the engine holds
        self._stopping = False
        self._fatal: BaseException | None = None
        self._stats_failed = False
        self._refresh_stats()

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is still running and stop the engine thread."""
        self._stopping = True
        for stream in list(self._streams.values()):
            stream._fail(EngineStoppedError("the server is shutting down"))
        self._streams.clear()
        self._not_started.clear()
        self._commands.put(("stop",))
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %.0fs", timeout)
        await asyncio.to_thread(self.engine.shutdown)  # tensor-parallel workers, if any

    @property
    def is_healthy(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self._fatal is None
                and not self._stopping)

    @property
    def num_waiting_requests(self) -> int:
        return len(self._not_started)

    # ---- requests (event loop side) ------------------------------------------------------
    def check_capacity(self, num_new: int = 1) -> None:
        """Raise QueueFullError if `num_new` more requests would overfill the waiting queue."""
        if len(self._not_started) + num_new > self.max_waiting_requests:
            raise QueueFullError(len(self._not_started), self.max_waiting_requests)

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          grammar: Any = None, arrival_time: float | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        `grammar` (a compiled grammar from `self.grammars`) constrains its output;
        `arrival_time` (monotonic) is when the request reached the server, so that its
        time to first token includes the wait for the engine thread.

        Raises ValueError (from the engine's validation) if the engine refused it, and
        EngineStoppedError while shutting down.
        """
        if self._stopping or not self.is_healthy:
            raise EngineStoppedError("the engine is not running")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self._not_started.add(request_id)
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._commands.put(("add", request_id, prompt_token_ids, params, grammar, arrival, accepted))
        self._wake.set()
        try:
            await asyncio.wrap_future(accepted)
        except BaseException:
            # Refused, or the caller went away while waiting: drop it on both sides.
            self._forget(request_id)
            refused = accepted.done() and not accepted.cancelled() and accepted.exception() is not None
            if not refused:
                self._commands.put(("abort", request_id))
                self._wake.set()
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); its KV blocks are freed by the engine thread."""
        if self._forget(request_id) is None:
            return
        self._commands.put(("abort", request_id))
        self._wake.set()

    def _forget(self, request_id: str) -> RequestStream | None:
        self._not_started.discard(request_id)
        return self._streams.pop(request_id, None)

    def _deliver(self, outputs: list[RequestOutput], failed: list[tuple[str, BaseException]]) -> None:
        """Runs on the event loop: route one step's results to their streams."""
        for out in outputs:
            self._not_started.discard(out.request_id)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]
        for request_id, error in failed:
            stream = self._forget(request_id)
            if stream is not None:
                stream._fail(error)

    # ---- the engine thread --------------------------------------------------------------------
    def _post(self, outputs: list[RequestOutput], failed: list[tuple[str, BaseException]]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._deliver, outputs, failed)
        except RuntimeError:
            pass  # the loop closed while we were stepping: nobody is listening any more

    def _run(self) -> None:
        try:
            while True:
                if not self._drain_commands():
                    break
                if not self.engine.has_unfinished():
                    self._refresh_stats()
                    self._wake.wait(IDLE_POLL_S)
                    self._wake.clear()
                    continue
                self._step()
        except BaseException as e:  # a bug in the loop itself: report it, fail everything
            logger.exception("engine thread died")
            self._fatal = e
            self._post([], [(rid, EngineStoppedError(f"the engine stopped: {e}")) for rid in self._live])
        finally:
            for rid in list(self._live):
                self._abort_in_engine(rid)

    def _drain_commands(self) -> bool:
        """Apply queued commands; False once told to stop."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            kind = cmd[0]
            if kind == "add":
                _, request_id, prompt_ids, params, grammar, arrival, accepted = cmd
                if not accepted.set_running_or_notify_cancel():
                    continue  # the caller gave up before the engine got to it
                try:
                    self.engine.add_request(request_id, prompt_ids, params, arrival_time=arrival, grammar=grammar)
                except Exception as e:  # ValueError naming the field, or anything else
                    accepted.set_exception(e)
                    continue
                self._live.add(request_id)
                accepted.set_result(None)
            elif kind == "abort":
                self._abort_in_engine(cmd[1])
            elif kind == "stop":
                return False

    def _abort_in_engine(self, request_id: str) -> None:
        self._live.discard(request_id)
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort of request %s failed", request_id)

    def _step(self) -> None:
        running_before = self._running_request_ids()
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.stats.num_step_failures += 1
            affected = (running_before | self._running_request_ids()) & self._live
            if not affected:
                affected = set(self._live)
            logger.exception("engine step failed; failing %d request(s): %s", len(affected), sorted(affected))
            error: Exception = EngineStepError(
                f"the engine failed while running this request: {type(e).__name__}: {e}")
            if isinstance(e, WorkerFailedError):
                # A lost tensor-parallel worker ends the engine: /health turns 503, and this
                # and every later request get 503 (engine stopped), not a 500 per request.
                self._fatal = e
                affected = set(self._live)
                error = EngineStoppedError(f"the engine stopped: {e}")
            for rid in affected:
                self._abort_in_engine(rid)
            self._post([], [(rid, error) for rid in affected])
            self._refresh_stats()
            return
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        self._refresh_stats()
        if outputs:
            self._post(outputs, [])

    def _running_request_ids(self) -> set[str]:
        try:
            return {seq.request_id for seq in self.engine.scheduler.running}
        except Exception:
            return set()

    def _refresh_stats(self) -> None:
        try:
            e = self.engine.stats()
        except Exception:  # metrics must never take the engine thread down
            if not self._stats_failed:
                logger.exception("engine.stats() failed; engine gauges will be stale")
                self._stats_failed = True
            return
        s = self.stats
        s.num_waiting_seqs = e.num_waiting
        s.num_running_seqs = e.num_running
        s.kv_blocks_used = e.num_used_blocks
        s.kv_blocks_total = e.num_kv_blocks
        s.prefix_cache_queries = e.prefix_cache_queries
        s.prefix_cache_hits = e.prefix_cache_hits
        s.num_steps = e.num_steps
        s.num_preemptions = e.num_preemptions
        s.num_guided_requests = self.engine.grammar_masker.num_guided
