"""A tensor-parallel worker: one rank's model, KV cache and runner, in its own process.

The same `RankWorker` serves both executors (kiln.runtime.tp_executor): a process started by
the engine on this host (`worker_process_main`, the `mp` backend) or a Ray actor (the `ray`
backend). It joins the group's `torch.distributed` process group (NCCL on CUDA, gloo on CPU),
builds its rank's graph (kiln.passes.shard_tensor_parallel), reads only its slices of the
weights, and then runs every step the engine sends it; only rank 0 sends logits back.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kiln.compiler.graph_inputs import StepInputs
from kiln.compiler.model_source import resolve_model
from kiln.kernels.collectives import (OneShotAllReduce, disable_one_shot_all_reduce,
                                        enable_one_shot_all_reduce)
from kiln.runtime.config import EngineConfig
from kiln.runtime.kv_cache import (allocate_kv_cache, allocate_states, cuda_graph_sizes, mixed_graph_token_sizes,
                                   size_kv_cache)
from kiln.runtime.kv_scale_calibration import kv_scales_at_startup
from kiln.runtime.model_loading import load_model, peak_memory


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died or raised; the engine cannot go on. Names the rank."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"tensor-parallel worker rank {rank} {message}")
        self.rank = rank


@dataclass
class WorkerSpec:
    """What a worker needs to start: the engine's options and its place in the group."""

    config: EngineConfig
    rank: int
    world_size: int
    init_method: str  # torch.distributed rendezvous (file:// on one host, tcp:// across hosts)
    max_model_len: int
    # CUDA device index on its host (None: use the rank, or the only GPU Ray gave the actor).
    local_device: int | None = None
    # `mp` backend: a shared-memory block (name, rows) rank 0 writes the logits of a step of
    # up to `rows` sampled rows into, instead of sending them through the socket.
    logits_shm: tuple[str, int] | None = None
    # `mp` backend on CUDA: rank 0 shares a logits buffer on its GPU with the engine instead
    # (DeviceLogitsBuffer), of logits_shm's rows x vocab_size.
    logits_on_device: bool = False
    vocab_size: int = 0


class RankWorker:
    """One rank of the group. Methods are called in order: `report` (after start-up),
    `allocate_kv_cache(num_blocks)` once, then `execute` per step, then `shutdown`."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        # One set of progress bars (rank 0's), not one per rank on the same terminal.
        config = dataclasses.replace(spec.config, progress=spec.config.progress and spec.rank == 0)
        engine_device = config.resolved_device()
        if engine_device.type == "cuda":
            index = spec.local_device if spec.local_device is not None else spec.rank % torch.cuda.device_count()
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
            # The ranks share the host's cores: each its share, or their OpenMP threads spin
            # against each other at every collective (on 2 cores, TP=2 decode ran 10x slower).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
        self.timings: dict[str, float] = {}
        t0 = time.perf_counter()
        dist.init_process_group(backend, init_method=spec.init_method, rank=spec.rank, world_size=spec.world_size,
                                **({"device_id": self.device} if backend == "nccl" else {}))
        self.timings["join process group"] = time.perf_counter() - t0
        source = resolve_model(config.model, config.load_format, revision=config.revision,
                               download_dir=config.download_dir)
        self.model_config = source.config
        self.dtype = config.resolved_dtype(self.device)
        self.kv_cache_dtype = config.resolved_kv_cache_dtype(self.dtype)  # e4m3 for kv_cache_dtype="fp8"
        self.one_shot: OneShotAllReduce | None = None
        if self.device.type == "cuda" and spec.world_size > 1:
            t0 = time.perf_counter()
            # Small all-reduces (every decode step's) over peer-to-peer buffers, not NCCL:
            # kiln.kernels.collectives says why it is off unless $KILN_ONE_SHOT_ALL_REDUCE_MAX_BYTES asks.
            self.one_shot = enable_one_shot_all_reduce(self.dtype, self.device)
            self.timings["one-shot all-reduce buffer"] = time.perf_counter() - t0
        self.config = config
        self.model = load_model(config, source, self.dtype, self.device, self.timings, tp_rank=spec.rank)
        self.memory_after_load = peak_memory(self.device)
        # The recurrent layers' states (of this rank's heads) first: the KV cache gets what is left.
        self.states = allocate_states(config, self.model_config, self.dtype, self.device)
        self.num_blocks, self.activation_peak_bytes = size_kv_cache(
            config, self.model_config, self.kv_cache_dtype, self.device, spec.max_model_len, self.model.make_runner,
            self.states)
        self.runner: Any = None

    def report(self) -> dict[str, Any]:
        """Start-up facts the engine logs and combines: blocks that fit, memory, timings."""
        return {"rank": self.spec.rank, "num_blocks": self.num_blocks, "device": str(self.device),
                "activation_peak_bytes": self.activation_peak_bytes, "memory": self.memory_after_load,
                "timings": dict(self.timings), "startup_report": self.model.prepared.report,
                "pass_records": self.model.prepared.spec.pass_records,  # what each graph pass did on this rank
                "one_shot_all_reduce_max_bytes": self.one_shot.max_bytes if self.one_shot else 0,
                "num_state_slots": next(iter(self.states.values())).shape[0] if self.states else 0,
                "pid": os.getpid()}

    def allocate_kv_cache(self, num_blocks: int) -> dict[str, Any]:
        """The KV cache of `num_blocks` blocks (the smallest any rank fits), the runner, an FP8
        KV cache's scales (calibrated by every rank at once, each over the heads it holds, when
        the checkpoint has none: kv_scales_at_startup), and on CUDA this rank's decode CUDA
        graphs (every rank captures its own). Returns `memory_with_kv_cache` (peak memory) and
        `kv_scales` (the line to log, or None)."""
        config = self.config
        kv = allocate_kv_cache(config, self.model_config, num_blocks, self.kv_cache_dtype, self.device)
        self.runner = self.model.make_runner(kv, self.states)
        # The engine's own limits, so every rank calibrates on the same tokens as TP=1 would.
        _, kv_scales = kv_scales_at_startup(self.runner, self.model.prepared.spec.input_roles,
                                            self.model.checkpoint_kv_scales, config, int(self.model_config.vocab_size),
                                            self.spec.max_model_len, num_blocks, self.timings)
        if self.device.type == "cuda" and not config.enforce_eager:
            t0 = time.perf_counter()
            plan = self.model.prepared.plan
            self.runner.capture_cuda_graphs(cuda_graph_sizes(plan), -(-self.spec.max_model_len // config.block_size),
                                            mixed_graph_token_sizes(config, plan, bool(self.states)), plan.max_num_seqs)
            self.timings["capture CUDA graphs"] = time.perf_counter() - t0
        return {"memory_with_kv_cache": peak_memory(self.device), "kv_scales": kv_scales}

    def execute(self, inputs: dict[str, Any], input_ids: Any, as_numpy: bool = True) -> Any:
        """Run one step on this rank (inputs as numpy arrays); rank 0 returns the logits (a
        numpy array on the host, or with `as_numpy=False` the tensor where it is), the others None."""
        # Copies: Ray passes read-only views of its object store (and they are a few KB).
        step = StepInputs({name: torch.from_numpy(a.copy()) for name, a in inputs.items()})
        ids = torch.from_numpy(input_ids.copy()).to(self.device) if input_ids is not None else None
        logits = self.runner.execute(step, ids)
        if self.spec.rank != 0:
            return None
        return logits.cpu().numpy() if as_numpy else logits

    def shutdown(self) -> None:
        disable_one_shot_all_reduce()
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_with_parent(parent: int) -> None:
    """A worker never outlives the engine: if the engine process dies (even by SIGKILL, which
    runs no clean-up), its workers exit within a second."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


class LogitsBuffer:
    """Rank 0's view of the engine's shared-memory logits block (kiln.runtime.tp_executor):
    at batch 64 and a 128k vocabulary a step's logits are 33 MB, which through the socket
    cost three copies and a pickle; here they cost one copy, straight from the device."""

    def __init__(self, name: str, rows: int):
        from multiprocessing import resource_tracker, shared_memory

        self.shm = shared_memory.SharedMemory(name=name)
        # The engine owns the block; this process's tracker must not unlink it at exit.
        resource_tracker.unregister(self.shm._name, "shared_memory")  # type: ignore[attr-defined]
        self.flat = torch.frombuffer(self.shm.buf, dtype=torch.float32)
        self.rows = rows

    def write(self, logits: Any) -> tuple[str, int, int] | None:
        """("shm", rows, vocab) once `logits` is in the block; None if it does not fit."""
        if logits.dim() != 2 or logits.shape[0] * logits.shape[1] > self.flat.numel():
            return None
        rows, vocab = logits.shape
        self.flat[: rows * vocab].view(rows, vocab).copy_(logits)
        return ("shm", rows, vocab)


class DeviceLogitsBuffer:
    """Rank 0's logits on its GPU, shared with the engine process by CUDA IPC (`mp` backend on
    CUDA): the engine samples on that GPU, as a one-GPU engine does, so a step's logits never
    visit the host (33 MB a step at batch 64 and a 128k vocabulary: ~10 ms through the host
    with the draw) and seeded draws are the same as at TP=1.

    Two slots, used in turn: with async scheduling the engine launches step N+1 before it
    reads N's draw back, so N+1's logits must not land where N's draw may still be reading;
    the engine reads N's draw back before it launches N+2."""

    def __init__(self, rows: int, vocab: int, device: torch.device):
        self.slots = torch.empty((2, rows, vocab), dtype=torch.float32, device=device)
        self.next_slot = 0

    def write(self, logits: torch.Tensor) -> tuple[str, int, int] | None:
        """("cuda", slot, rows) once `logits` is in the slot and visible to other processes
        (the stream is synchronized); None if it does not fit."""
        if logits.dim() != 2 or logits.shape[0] > self.slots.shape[1] or logits.shape[1] != self.slots.shape[2]:
            return None
        slot, rows = self.next_slot, logits.shape[0]
        self.slots[slot, :rows].copy_(logits)
        torch.cuda.current_stream(self.slots.device).synchronize()
        self.next_slot = 1 - slot
        return ("cuda", slot, rows)


@dataclass
class StepStats:
    """Where a worker's time goes between start-up and now (reset on read): waiting for the
    engine's next message, and handling steps (inputs in, replay, logits out)."""

    steps: int = 0
    wait_s: float = 0.0
    execute_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        per = 1e3 / max(1, self.steps)
        return {"steps": self.steps, "wait_ms_per_step": self.wait_s * per, "execute_ms_per_step": self.execute_s * per}


def worker_process_main(spec: WorkerSpec, conn: Any, parent_pid: int) -> None:
    """The `mp` backend's worker process: messages from the engine on `conn`, in order:
    ("allocate", num_blocks), ("step", inputs, input_ids)..., ("shutdown",), and at any point
    between steps ("stats",). It answers ("ready", report), ("allocated", what
    allocate_kv_cache returns), rank 0 ("logits", where) per step, ("stats",
    StepStats.as_dict()), or ("error", traceback) before exiting when anything raises."""
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    worker = None
    try:
        worker = RankWorker(spec)
        buffer: LogitsBuffer | DeviceLogitsBuffer | None = None
        report = worker.report()
        if spec.rank == 0 and worker.device.type == "cuda" and spec.logits_shm and spec.logits_on_device:
            buffer = DeviceLogitsBuffer(spec.logits_shm[1], spec.vocab_size, worker.device)
            report["device_logits"] = buffer.slots  # pickled as a CUDA IPC handle (torch.multiprocessing)
        elif spec.logits_shm and spec.rank == 0:
            buffer = LogitsBuffer(*spec.logits_shm)
        conn.send(("ready", report))
        stats = StepStats()
        while True:
            t0 = time.perf_counter()
            message = conn.recv()
            t1 = time.perf_counter()
            kind = message[0]
            if kind == "step":
                logits = worker.execute(message[1], message[2], as_numpy=buffer is None)
                if logits is not None:
                    conn.send(("logits", (buffer.write(logits) if buffer is not None else None)
                               or (logits if buffer is None else logits.cpu().numpy())))
                stats.steps += 1
                stats.wait_s += t1 - t0
                stats.execute_s += time.perf_counter() - t1
            elif kind == "stats":
                conn.send(("stats", stats.as_dict()))
                stats = StepStats()
            elif kind == "allocate":
                conn.send(("allocated", worker.allocate_kv_cache(message[1])))
            elif kind == "shutdown":
                break
    except EOFError:
        pass  # the engine went away
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        os._exit(1)  # a peer may be blocked in a collective with us: do not wait for clean-up
    if worker is not None:
        worker.shutdown()


def main(argv: list[str]) -> None:
    """A worker process's entry point (`main([ADDRESS, RANK])`, as the `mp` executor starts it): connect
    to the engine (key in $KILN_TP_AUTHKEY), say which rank, receive the WorkerSpec, serve."""
    from multiprocessing.connection import Client

    address, rank = argv[0], int(argv[1])
    conn = Client(address, "AF_UNIX", authkey=bytes.fromhex(os.environ.pop("KILN_TP_AUTHKEY")))
    conn.send(rank)
    spec = conn.recv()
    worker_process_main(spec, conn, os.getppid())

