"""The engine's side of tensor parallelism: start one worker per rank, give every rank the
same KV-cache size, send each step to all of them, take the logits from rank 0, and stop them.

The engine process schedules and samples (kiln.runtime.engine); it holds no weights. A step's
inputs (a few small CPU tensors: token ids, positions, slots, block tables) go to every rank,
each rank runs its shard of the graph (its collectives synchronise the ranks on the device),
and rank 0 returns the sampled rows' logits, already gathered over the vocabulary. See
runtime/README.md ("Tensor parallelism") for why.

Two backends run the same `RankWorker` (kiln.runtime.tp_worker): `mp`, processes on this
host connected by pipes, and `ray`, Ray actors in a placement group with one bundle per GPU.
Either way a worker that dies or raises makes the current and every later step raise
`WorkerFailedError` naming the rank, and the others are stopped: no step waits forever, and
no worker outlives the engine.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import queue
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import shared_memory
from typing import Any, Callable

import torch

from kiln.runtime.config import EngineConfig
from kiln.runtime.tp_worker import WorkerFailedError, WorkerSpec

logger = logging.getLogger("kiln.runtime")

# How often a wait for a worker looks at whether every worker is still alive.
LIVENESS_POLL_S = 0.5
# A worker process's program. Not `-m kiln.runtime.tp_worker`: importing the package first
# (kiln.runtime imports the engine, which imports tp_worker) would load that module twice.
WORKER_COMMAND = "import sys; from kiln.runtime.tp_worker import main; main(sys.argv[1:])"
# How long shutdown waits for a worker to exit by itself before it is killed.
SHUTDOWN_GRACE_S = 5.0
# How long a worker's error report waits for a peer's exit to show (see _check_message).
PEER_DEATH_GRACE_S = 1.0


class PendingLogits:
    """A step sent to the ranks: calling it waits for rank 0's logits and returns them (the
    first call reads them, later calls return the same tensor)."""

    def __init__(self, read: Callable[[], torch.Tensor]):
        self._read: Callable[[], torch.Tensor] | None = read
        self._logits: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self._read is not None:
            read, self._read = self._read, None
            self._logits = read()
        if self._logits is None:
            raise RuntimeError("a tensor-parallel step's logits were lost: reading them failed earlier")
        return self._logits


class TensorParallelExecutor:
    """What the engine calls in place of a ModelRunner when tensor_parallel_size > 1:
    `submit(inputs, input_ids) -> PendingLogits` (the step goes to every rank; the logits are
    read when the pending step is called), plus `shutdown()`.

    Submitting returns at once so that the engine's host work overlaps the ranks' step: with
    async scheduling the engine sends decode step N+1, then processes step N's tokens, and
    reads N+1's logits only when it draws from them (LLMEngine.step)."""

    bucket_fns = None  # prompt_logprobs checks (LLMEngine.validate_request): see rank 0's mode
    num_kv_blocks: int
    reports: list[dict[str, Any]]

    def submit(self, inputs: Any, input_ids: torch.Tensor | None = None) -> PendingLogits:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def _combine(self, reports: list[dict[str, Any]]) -> int:
        """Every rank's KV cache gets the smallest block count any rank fits."""
        self.reports = sorted(reports, key=lambda r: r["rank"])
        for r in self.reports:
            memory = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in r["memory"].items())
            logger.info("tensor-parallel rank %d on %s: %d KV blocks fit; after loading its weights: %s",
                        r["rank"], r["device"], r["num_blocks"], memory)
        self.startup_report = self.reports[0]["startup_report"]
        # Rank 0's artifacts decide whether prompt logprobs can run (fixed logits rows).
        self.bucket_fns = {} if self.startup_report.mode == "inductor" else None
        return min(r["num_blocks"] for r in self.reports)


class MultiprocExecutor(TensorParallelExecutor):
    """Workers as processes on this host (`kiln.runtime.tp_worker.main`), one per rank,
    connected to the engine by a local socket (multiprocessing.connection, with a random
    key). Not `multiprocessing`'s spawn: that re-imports the user's main script in every
    worker, which breaks any script without an `if __name__ == "__main__"` guard."""

    def __init__(self, config: EngineConfig, max_model_len: int, vocab_size: int):
        self.world_size = config.tensor_parallel_size
        self._failure: WorkerFailedError | None = None
        self.processes: list[subprocess.Popen[bytes]] = []
        self.conns: list[Any] = [None] * self.world_size
        self._scratch = tempfile.mkdtemp(prefix="kiln-tp-")
        # Rank 0 writes a step's logits here (up to max_num_seqs rows: every decode step;
        # larger steps, with prompt logprobs, go through the socket). Sized from the config's
        # vocabulary: the LM head's rows, gathered, are exactly that many.
        self._logits = shared_memory.SharedMemory(create=True, size=4 * vocab_size * config.max_num_seqs)
        self._logits_flat = torch.frombuffer(self._logits.buf, dtype=torch.float32)
        self._device_logits: torch.Tensor | None = None  # rank 0's, on CUDA (set once it reports)
        self._unread: PendingLogits | None = None  # the step submitted last, until its logits are read
        authkey = secrets.token_bytes(32)
        listener = multiprocessing.connection.Listener(os.path.join(self._scratch, "engine.sock"), "AF_UNIX",
                                                       authkey=authkey)
        try:
            env = {**os.environ, "KILN_TP_AUTHKEY": authkey.hex()}
            for rank in range(self.world_size):
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-c", WORKER_COMMAND, str(listener.address), str(rank)],
                    env=env, stdin=subprocess.DEVNULL))
            self._accept(listener)
            init = f"file://{os.path.join(self._scratch, 'rendezvous')}"
            on_device = config.resolved_device().type == "cuda" and os.environ.get("KILN_TP_DEVICE_LOGITS", "1") != "0"
            for rank, conn in enumerate(self.conns):
                conn.send(WorkerSpec(config=config, rank=rank, world_size=self.world_size, init_method=init,
                                     max_model_len=max_model_len,
                                     logits_shm=(self._logits.name, config.max_num_seqs),
                                     logits_on_device=on_device, vocab_size=vocab_size))
            reports = list(self._gather(list(range(self.world_size)), "ready").values())
            # Rank 0's logits buffer on its GPU (CUDA IPC): this process samples there.
            device_logits = [r.pop("device_logits") for r in reports if "device_logits" in r]
            self._device_logits = device_logits[0] if device_logits else None
            self.num_kv_blocks = self._combine(reports)
            for conn in self.conns:
                conn.send(("allocate", self.num_kv_blocks))
            for rank, allocated in self._gather(list(range(self.world_size)), "allocated").items():
                self.reports[rank].update(allocated)
        except BaseException:
            self.shutdown()
            raise
        finally:
            listener.close()

    def _accept(self, listener: Any) -> None:
        """Each worker's connection (it sends its rank first), failing if one exits first."""
        accepted: queue.SimpleQueue[Any] = queue.SimpleQueue()

        def accept_all() -> None:
            for _ in range(self.world_size):
                try:
                    accepted.put(listener.accept())
                except Exception as e:  # the listener closed: start-up failed meanwhile
                    accepted.put(e)
                    return

        threading.Thread(target=accept_all, daemon=True, name="kiln-tp-accept").start()
        while any(c is None for c in self.conns):
            try:
                conn = accepted.get(timeout=LIVENESS_POLL_S)
            except queue.Empty:
                self._check_alive()
                continue
            if isinstance(conn, Exception):
                raise conn
            self.conns[conn.recv()] = conn

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def submit(self, inputs: Any, input_ids: torch.Tensor | None = None) -> PendingLogits:
        if self._failure is not None:
            raise self._failure
        if not self.conns:
            raise RuntimeError("the engine's tensor-parallel workers have been shut down (LLMEngine.shutdown)")
        self._read_unread()  # rank 0 answers in order: an earlier step's logits come first
        # Sent as numpy arrays, pickled by value: torch's own pickling of CPU tensors passes
        # shared-memory file descriptors, a round trip per tensor that needs the sender's key.
        message = ("step", {name: t.numpy() for name, t in inputs.items()},
                   None if input_ids is None else input_ids.cpu().numpy())
        try:
            for rank, conn in enumerate(self.conns):
                self._send(rank, conn, message)
        except WorkerFailedError:
            self.shutdown()
            raise
        self._unread = PendingLogits(self._read_logits)
        return self._unread

    def _read_unread(self) -> None:
        """Read the last submitted step's logits if nobody has yet (they stay in its PendingLogits)."""
        if self._unread is not None:
            self._unread()

    def _read_logits(self) -> torch.Tensor:
        self._unread = None
        try:
            logits = self._receive(0, "logits")
        except WorkerFailedError:
            self.shutdown()
            raise
        if isinstance(logits, tuple) and logits[0] == "cuda":  # ("cuda", slot, rows): on rank 0's GPU
            _, slot, rows = logits
            if self._device_logits is None:
                raise RuntimeError("rank 0 answered with device logits it never shared (a bug in Kiln)")
            return self._device_logits[slot, :rows]  # two slots: see tp_worker.DeviceLogitsBuffer
        if isinstance(logits, tuple):  # ("shm", rows, vocab): in the shared block
            _, rows, vocab = logits
            # A copy: the next step (sent before this one's draw is read back, with async
            # scheduling) overwrites the block.
            out = self._logits_flat[: rows * vocab].view(rows, vocab).clone()
        else:
            out = torch.from_numpy(logits)
        # Every draw on one device (the sampler's seeded generators are per device).
        return out.to(self._device_logits.device) if self._device_logits is not None else out

    def step_stats(self) -> dict[str, Any]:
        """Each worker's StepStats since the last call (and reset them): how much of a step
        each rank spends handling it and how much waiting for the next (bench/tp.py)."""
        self._read_unread()
        for rank, conn in enumerate(self.conns):
            self._send(rank, conn, ("stats",))
        return {f"rank{rank}": stats for rank, stats in sorted(self._gather(list(range(self.world_size)),
                                                                               "stats").items())}

    def _send(self, rank: int, conn: Any, message: Any) -> None:
        try:
            conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._fail(rank, self._death(rank))

    def _death(self, rank: int) -> str:
        process = self.processes[rank]
        try:
            code = process.wait(0.2)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"died (pid {process.pid} {how}: out of memory, killed, or crashed)"

    def _fail(self, rank: int, message: str) -> None:
        self._failure = WorkerFailedError(rank, message)
        logger.error("%s", self._failure)
        raise self._failure

    def _peer_killed(self, rank: int, within_s: float) -> int | None:
        """A rank other than `rank` whose process a signal ended, waiting up to `within_s` for one."""
        deadline = time.monotonic() + within_s
        while True:
            for other, process in enumerate(self.processes):
                code = process.poll() if other != rank else None
                if code is not None and code < 0:
                    return other
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _check_alive(self) -> None:
        for rank, process in enumerate(self.processes):
            if process.poll() is not None:
                self._fail(rank, self._death(rank))

    def _receive(self, rank: int, expected: str) -> Any:
        return self._gather([rank], expected)[rank]

    def _gather(self, ranks: list[int], expected: str) -> dict[int, Any]:
        """The next message of each rank in `ranks`, each of which must be `expected`. While
        waiting, any worker that dies or reports an error fails the wait (a dead peer would
        block the others in a collective forever); other ranks send nothing but errors."""
        pending, out = set(ranks), {}
        while pending:
            ready = multiprocessing.connection.wait(self.conns, timeout=LIVENESS_POLL_S)
            for rank, conn in enumerate(self.conns):  # messages first: a failing worker reports, then exits
                if conn in ready:
                    out[rank] = self._check_message(rank, conn, expected if rank in pending else None)
                    pending.discard(rank)
            if pending:
                self._check_alive()
        return out

    def _check_message(self, rank: int, conn: Any, expected: str | None) -> Any:
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            self._fail(rank, self._death(rank))
        if kind == "error":
            # A peer killed by a signal (OOM killer, SIGKILL, a segfault) breaks its partners'
            # collectives (gloo: "Connection reset by peer"), and a partner's report can arrive
            # before the peer's exit is seen: name the peer that died, the cause, rather than
            # the rank that noticed. (A worker that raises reports first and exits with status
            # 1; its partners' reports then name it by their own tracebacks.)
            dead = self._peer_killed(rank, within_s=PEER_DEATH_GRACE_S)
            if dead is not None:
                self._fail(dead, f"{self._death(dead)}; rank {rank} then failed with: "
                                 f"{str(value).strip().splitlines()[-1]}")
            self._fail(rank, f"failed:\n{value}")
        if kind != expected:
            self._fail(rank, f"sent {kind!r} where {expected!r} was expected (a bug in Kiln)")
        return value

    def shutdown(self) -> None:
        """Stop every worker: ask, wait a little, then kill. Idempotent."""
        # Let go of rank 0's shared logits first: the memory is the worker's (CUDA IPC).
        self._device_logits = None
        for conn in self.conns:
            try:
                conn.send(("shutdown",))
            except Exception:
                pass
        for process in self.processes:
            try:
                process.wait(SHUTDOWN_GRACE_S if self._failure is None else 0.5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(SHUTDOWN_GRACE_S)
        for conn in self.conns:
            if conn is not None:
                conn.close()
        self.conns = []
        shutil.rmtree(self._scratch, ignore_errors=True)
        if getattr(self, "_logits", None) is not None:
            del self._logits_flat  # the buffer's exported views must go before it closes
            self._logits.close()
            self._logits.unlink()
            self._logits = None


def start_executor(config: EngineConfig, max_model_len: int, vocab_size: int) -> TensorParallelExecutor:
    """The workers of config.tensor_parallel_size ranks on config.distributed_executor_backend."""
    if config.distributed_executor_backend == "ray":
        from kiln.runtime.tp_ray import RayExecutor

        return RayExecutor(config, max_model_len)
    return MultiprocExecutor(config, max_model_len, vocab_size)
