"""The `ray` backend of tensor parallelism: the workers as Ray actors, across hosts.

A placement group reserves one bundle per rank (one GPU and one CPU each on CUDA, one CPU on
CPU); each actor runs the same `RankWorker` as the `mp` backend's processes. Rank 0's actor
names a TCP address on its node for the `torch.distributed` rendezvous (NCCL or gloo then
connect the ranks directly, whatever hosts they are on). The engine joins the Ray cluster
the caller connected to (`ray.init(address=...)`), or $RAY_ADDRESS, or starts a local one.

Ray is an optional dependency (`pip install kiln[ray]`). A dead actor (killed, out of
memory, its node lost) surfaces as Ray's actor error on the step's result, which becomes
`WorkerFailedError` naming the rank; the actors are owned by the engine's process, so Ray
ends them with it.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import torch

from kiln.runtime.config import EngineConfig
from kiln.runtime.tp_executor import LIVENESS_POLL_S, PendingLogits, TensorParallelExecutor
from kiln.runtime.tp_worker import RankWorker, WorkerFailedError, WorkerSpec

logger = logging.getLogger("kiln.runtime")
# How long a rank's failure waits to see whether a peer's actor died (the cause, then).
DEAD_PEER_GRACE_S = 5.0
_ACTOR_DIED = "died (its Ray actor is gone: killed, out of memory, or its node lost)"


class RankActor:
    """One rank as a Ray actor (wrapped by `ray.remote` when the executor starts)."""

    def __init__(self) -> None:
        self.worker: RankWorker | None = None

    def rendezvous_address(self) -> str:
        """tcp://<this node's IP>:<a free port>, for the group's rendezvous (rank 0's)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def start(self, spec: WorkerSpec) -> dict[str, Any]:
        self.worker = RankWorker(spec)
        report = self.worker.report()
        report["node"] = socket.gethostname()
        return report

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def allocate(self, num_blocks: int) -> dict[str, Any]:
        assert self.worker is not None
        return self.worker.allocate_kv_cache(num_blocks)

    def execute(self, inputs: dict[str, Any], input_ids: Any) -> Any:
        assert self.worker is not None
        return self.worker.execute(inputs, input_ids)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


class RayExecutor(TensorParallelExecutor):
    def __init__(self, config: EngineConfig, max_model_len: int):
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as e:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'kiln[ray]'") from e
        self._ray = ray
        self.world_size = config.tensor_parallel_size
        self._failure: WorkerFailedError | None = None
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        cuda = config.resolved_device().type == "cuda" if config.device != "auto" else self._cluster_has_gpus()
        bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
        self.placement_group = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=120)
        if not ready:
            ray.util.remove_placement_group(self.placement_group)
            raise ValueError(f"Ray could not reserve {self.world_size} bundles of {bundle} (tensor_parallel_size="
                             f"{self.world_size}); the cluster has {ray.cluster_resources()}")
        actor_class = ray.remote(num_cpus=1, num_gpus=1 if cuda else 0)(RankActor)
        self.actors = [actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=rank)).remote()
            for rank in range(self.world_size)]
        try:
            init = ray.get(self.actors[0].rendezvous_address.remote())
            self.worker_pids = ray.get([a.pid.remote() for a in self.actors])
            self.worker_nodes = ray.get([a.node_id.remote() for a in self.actors])
            specs = [WorkerSpec(config=config, rank=rank, world_size=self.world_size, init_method=init,
                                max_model_len=max_model_len, local_device=0 if cuda else None)
                     for rank in range(self.world_size)]
            reports = self._gather([a.start.remote(s) for a, s in zip(self.actors, specs)])
            self.num_kv_blocks = self._combine(reports)
            for rank, allocated in enumerate(self._gather([a.allocate.remote(self.num_kv_blocks)
                                                           for a in self.actors])):
                self.reports[rank].update(allocated)
        except BaseException:
            self.shutdown()
            raise

    def _cluster_has_gpus(self) -> bool:
        return self._ray.cluster_resources().get("GPU", 0) > 0 or torch.cuda.is_available()

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every rank's result; an actor that died or raised fails the call naming its rank."""
        ray = self._ray
        index = {ref: rank for rank, ref in enumerate(refs)}
        pending, out = list(refs), [None] * len(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=LIVENESS_POLL_S)
            for ref in ready:
                rank = index[ref]
                try:
                    out[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(rank, f"{_ACTOR_DIED}: {e}")
                except ray.exceptions.RayTaskError as e:
                    # A rank whose peer was killed fails too, in the collective (connection
                    # reset); when a peer's actor turns out dead, that death is the cause.
                    dead = self._dead_peer([r for r in refs if r is not ref], index)
                    if dead is not None:
                        self._fail(dead[0], f"{_ACTOR_DIED}: {dead[1]}")
                    self._fail(rank, f"failed:\n{e}")
        return out

    def _dead_peer(self, refs: list[Any], index: dict[Any, int]) -> tuple[int, Exception] | None:
        """(rank, error) of the first of `refs` whose actor is dead, waiting up to
        DEAD_PEER_GRACE_S for Ray to notice; None if none is."""
        ray = self._ray
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=DEAD_PEER_GRACE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return index[ref], e
            except ray.exceptions.RayTaskError:
                pass
        return None

    def _fail(self, rank: int, message: str) -> None:
        self._failure = WorkerFailedError(rank, message)
        logger.error("%s", self._failure)
        raise self._failure

    def submit(self, inputs: Any, input_ids: torch.Tensor | None = None) -> PendingLogits:
        if self._failure is not None:
            raise self._failure
        if not self.actors:
            raise RuntimeError("the engine's tensor-parallel workers have been shut down (LLMEngine.shutdown)")
        arrays = {name: t.numpy() for name, t in inputs.items()}
        ids = None if input_ids is None else input_ids.cpu().numpy()
        # An actor runs its calls in order, so this step queues behind any still running.
        refs = [a.execute.remote(arrays, ids) for a in self.actors]

        def read() -> torch.Tensor:
            try:
                results = self._gather(refs)
            except WorkerFailedError:
                self.shutdown()
                raise
            return torch.from_numpy(results[0].copy())  # Ray hands back a read-only view of its object store

        return PendingLogits(read)

    def shutdown(self) -> None:
        ray = self._ray
        for actor in getattr(self, "actors", []):
            try:
                ray.kill(actor)
            except Exception:
                pass
        self.actors = []
        if getattr(self, "placement_group", None) is not None:
            try:
                ray.util.remove_placement_group(self.placement_group)
            except Exception:
                pass
            self.placement_group = None
