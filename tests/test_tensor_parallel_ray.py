"""Tensor parallelism on the Ray backend, on a real two-node Ray cluster on this machine
(`ray.cluster_utils.Cluster`: a head and a second node, one CPU each, so the two ranks'
bundles land on different nodes), TP=2 over gloo: TP=1's greedy tokens, and a killed actor
fails the engine naming its rank."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from kiln.runtime.llm import LLM  # noqa: E402
from kiln.runtime.tp_worker import WorkerFailedError  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_tensor_parallel import GREEDY, OPTIONS, PROMPTS, _all_exit, _save, _tokens  # noqa: E402


@pytest.fixture(scope="module")
def two_node_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_ray_tp2_across_two_nodes(two_node_cluster, tmp_path: Path) -> None:
    model = str(_save("llama", tmp_path / "llama"))
    expected = _tokens(LLM(model, **OPTIONS).generate(PROMPTS, GREEDY))
    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", **OPTIONS)
    executor = llm.engine.executor
    try:
        assert len(set(executor.worker_nodes)) == 2  # one rank per node
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match="rank 1 died"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - t0 < 60
    finally:
        llm.engine.shutdown()
    assert _all_exit(executor.worker_pids, within_s=20)
