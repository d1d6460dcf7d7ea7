"""A replica over the step protocol gives the in-process engine's tokens, plain and overlapped (on a GPU, and on CPU).

The worker is a real CUDA ``Worker`` behind a StepWorker server in a child process
(``bench.grpc_replica``), driven by ``EngineCore`` + ``GrpcReplicaExecutor`` as a cluster
replica is.  A CUDA worker launches ahead (``Worker.launches_ahead``): with overlapped
scheduling each plan reaches it while the step before runs, and it launches that plan
before it waits for that step, filling the plan's placeholders from its samples on the
device.  Greedy outputs must equal in-process ones (float32, the CUDA kernels).
"""

from __future__ import annotations

import dataclasses

import pytest

from kvserve import LLM, SamplingParams
from kvserve.bench.grpc_replica import StepProtocolReplica, worker_server
from kvserve.worker.tiny_model import create_tiny_model
from kvserve.worker.worker_config import WorkerConfig
from tests.engine.test_llm_parity import random_prompts


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu), "cpu"])
def test_a_worker_over_the_step_protocol_gives_the_in_process_tokens(tmp_path, device: str) -> None:
    # On CPU (no launching ahead) it checks the harness that bench.gpu_serving's part (e) runs
    # on a GPU: the child's server, its secret, the replica driving it.
    path = create_tiny_model(tmp_path, "llama", seed=3, head_dim=64)
    prompts = random_prompts(12, seed=13, lo=3, hi=60)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    with LLM(path, device=device, dtype="float32", num_blocks=256, max_num_seqs=16) as llm:
        expected = [output.token_ids for output in llm.generate(prompts, params)]
        config, model_config, num_blocks = llm.config, llm.model_config, llm.engine.executor.num_kv_blocks
    worker_config = dataclasses.replace(WorkerConfig.for_engine(config, model_config.max_model_len), num_blocks=num_blocks)
    with worker_server(worker_config) as (address, secret):
        replica = StepProtocolReplica(address, secret, config, model_config)
        try:
            for async_scheduling in (False, True):
                replica.engine.async_scheduling = async_scheduling
                assert replica.generate(prompts, params) == expected, f"async_scheduling={async_scheduling}"
        finally:
            replica.close()
