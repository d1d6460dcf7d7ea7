"""Live clusters of simulated replicas: real Ray and gRPC, no model, the simulator's figures.

Steps here last tens of milliseconds (``COST_MODEL`` x ``TIME_SCALE``), so
that Ray's and gRPC's few milliseconds per step are small against them.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import ray

from kvserve.experiments.experiment import add_experiment_parser
from kvserve.experiments.experiment_live import live_cluster_config, run_live
from kvserve.experiments.workloads import make_workload
from kvserve.cluster.config import ClusterConfig, ServerConfig
from kvserve.scheduler.engine_config import ParallelConfig
from kvserve.cluster.launcher import start_cluster
from kvserve.cluster.messages import RequestSpec
from kvserve.cluster.http_server import start_http_server
from kvserve.cluster.server import start_server
from kvserve.cluster.worker_actor import RAY_NAMESPACE, worker_actor_name
from kvserve.proto import generate_pb2, generate_pb2_grpc
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.routing.policies import make_policy
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulated_executor import synthetic_output_token_array
from kvserve.scheduler.simulation.simulated_worker import SimulationConfig
from kvserve.scheduler.simulation.simulator import FleetConfig, FleetSimulator
from kvserve.worker.model_config import ModelConfig
from kvserve.worker.tiny_model import create_tiny_model

COST_MODEL = StepCostModel(a=0.03, b=2e-4, c=1e-3, d=0.0)
TIME_SCALE = 2.0
NUM_REPLICAS = 4
TOLERANCE = 0.15


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("simulated-model"), "llama", seed=0)


@pytest.fixture(scope="module")
def vocab_size(model_dir: Path) -> int:
    return ModelConfig.from_pretrained(model_dir).vocab_size


def shared_prefix_stream(vocab_size: int, num_requests: int, qps: float):  # noqa: ANN201
    return make_workload(
        "shared_prefix", num_requests, qps, seed=0, num_groups=6, system_prompt_len=256, question_len=32,
        output_len=4, vocab_size=vocab_size, warmup_per_group=0,  # every request measured: live and simulated alike
    )


# Arrivals closer than this (in the replay's seconds) may reach the live scheduler in either order.
SAME_ARRIVAL_S = 0.005


def arrival_groups(arrival_times: list[float], within_s: float) -> list[list[int]]:
    """The requests' indices in runs whose consecutive arrivals are less than ``within_s`` apart."""
    groups: list[list[int]] = []
    for index, time_s in enumerate(arrival_times):
        if groups and time_s - arrival_times[groups[-1][-1]] < within_s:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def figures(records) -> tuple[float, float]:  # noqa: ANN001
    """Prefix-cache hit rate and TTFT p50."""
    hit_rate = sum(r.num_cached_tokens for r in records) / sum(r.num_prompt_tokens for r in records)
    return hit_rate, float(np.percentile([r.ttft for r in records], 50))


@pytest.mark.timing
def test_the_live_cluster_agrees_with_the_simulator_on_hit_rate_and_ttft(ray_cluster, model_dir, vocab_size):
    stream = shared_prefix_stream(vocab_size, num_requests=80, qps=16.0)
    fleet = FleetConfig(
        num_replicas=NUM_REPLICAS,
        scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=512),
        # 63 blocks of 16 tokens: room for about 3 of the 6 prefixes, so replicas evict.
        cache_config=CacheConfig(block_size=16, num_blocks=64),
        cost_model=COST_MODEL,
        vocab_size=vocab_size,
    )
    simulated = FleetSimulator(fleet, make_policy("round_robin")).run(stream)
    config = live_cluster_config(
        fleet, stream, model_dir=str(model_dir), policy="round_robin", time_scale=TIME_SCALE
    )

    lines: list[str] = []
    live = run_live(stream, config, label="round_robin", report=lines.append)
    print("\n".join(lines), file=sys.stderr)
    # How long the replay takes is told before it starts (a --qps knee rate can be low).
    arrivals_s = stream[-1].arrival_time * TIME_SCALE
    assert f"  round_robin: replaying 80 requests, arriving over {arrivals_s:.0f} s" in lines

    sim_hit_rate, sim_ttft = figures(simulated.records)
    live_hit_rate, live_ttft = figures(live.records)
    print(f"hit rate: sim {sim_hit_rate:.4f} live {live_hit_rate:.4f}; "
          f"TTFT p50: sim {sim_ttft:.4f} s live {live_ttft:.4f} s", file=sys.stderr)
    assert sim_hit_rate > 0.2
    assert live_hit_rate == pytest.approx(sim_hit_rate, rel=TOLERANCE)
    assert live_ttft == pytest.approx(sim_ttft, rel=TOLERANCE)
    # Requests that arrive together (this stream has two 32 us apart) are separate gRPC calls, which may
    # reach the scheduler in either order: round robin then swaps their replicas, and only theirs.
    together = arrival_groups([item.arrival_time * TIME_SCALE for item in stream], within_s=SAME_ARRIVAL_S)
    live_replicas = [r.replica_id for r in live.records]
    sim_replicas = [r.replica_id for r in simulated.records]
    assert [sorted(live_replicas[i] for i in group) for group in together] == [
        sorted(sim_replicas[i] for i in group) for group in together
    ]
    assert live.output_token_ids == [
        synthetic_output_token_array(str(i), item.num_prompt_tokens, item.output_len, vocab_size).tolist()
        for i, item in enumerate(stream)
    ]


def test_simulated_ranks_load_no_torch_and_serve_prompts_beyond_the_models_length(ray_cluster, model_dir, vocab_size):
    model_limit = ModelConfig.from_pretrained(model_dir).max_model_len
    config = ClusterConfig.from_kwargs(
        str(model_dir),
        parallel=ParallelConfig(tensor_parallel_size=2, num_replicas=1),
        block_size=16,
        num_blocks=2 * model_limit // 16 + 8,
        max_num_batched_tokens=4096,
        max_model_len=2 * model_limit,
        routing="round_robin",
        simulation=SimulationConfig(cost_model=COST_MODEL, time_scale=0.1),
    )
    handle = start_cluster(config)
    try:
        for rank in range(2):
            actor = ray.get_actor(worker_actor_name(0, rank), namespace=RAY_NAMESPACE)
            assert not ray.get(actor.__ray_call__.remote(lambda _: "torch" in sys.modules))
        assert handle.model_info.max_model_len == 2 * model_limit
        prompt = [5] * (model_limit + 100)

        async def generate() -> list[generate_pb2.GenerateResponse]:
            server = await start_server(handle.scheduler, handle.model_info, ServerConfig(port=0))
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                    request = generate_pb2.GenerateRequest(
                        token_ids=generate_pb2.TokenIds(ids=prompt), request_id="long",
                        sampling_params=generate_pb2.SamplingParams(max_tokens=3, ignore_eos=True),
                    )
                    stub = generate_pb2_grpc.GenerationStub(channel)
                    return [r async for r in stub.Generate(request, timeout=60)]
            finally:
                await server.stop(grace_s=1.0)

        responses = asyncio.run(generate())
    finally:
        handle.shutdown()

    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == synthetic_output_token_array("long", len(prompt), 3, vocab_size).tolist()
    assert responses[-1].usage.prompt_tokens == len(prompt)


def one_slow_replica(model_dir: Path) -> ClusterConfig:
    """One simulated replica whose steps take 60 ms: a stream of 1000 tokens lasts a minute."""
    return ClusterConfig.from_kwargs(
        str(model_dir),
        parallel=ParallelConfig(num_replicas=1),
        num_blocks=128,
        routing="round_robin",
        simulation=SimulationConfig(cost_model=COST_MODEL, time_scale=TIME_SCALE),
    )


async def requests_left(handle, timeout_s: float = 10.0) -> int:  # noqa: ANN001
    """The requests running or waiting on ``handle``'s replicas once none are, or at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := sum(s.num_running + s.num_waiting for s in await handle.scheduler.get_stats.remote())):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    return left


def test_a_stream_still_running_when_the_server_stops_is_told_so_and_its_request_aborted(ray_cluster, model_dir):
    # After the grace, grpc cancelled it with "UNAVAILABLE: Cancelling all calls".
    handle = start_cluster(one_slow_replica(model_dir))
    try:

        async def stopped_mid_stream() -> tuple[grpc.aio.AioRpcError, int]:
            server = await start_server(handle.scheduler, handle.model_info, ServerConfig(port=0))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                request = generate_pb2.GenerateRequest(
                    token_ids=generate_pb2.TokenIds(ids=[5] * 20),
                    sampling_params=generate_pb2.SamplingParams(max_tokens=1000, ignore_eos=True),
                )
                call = generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
                await call.read()  # under way: about a minute of tokens to come
                stopping = asyncio.ensure_future(server.stop(grace_s=0.5))
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                await stopping
            return error.value, await requests_left(handle)

        error, running = asyncio.run(stopped_mid_stream())
    finally:
        handle.shutdown()

    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "the server is shutting down"
    assert running == 0  # aborted, not left to run out its 1000 tokens


def test_http_answers_still_running_when_the_server_stops_are_told_so_and_their_requests_aborted(
    ray_cluster, model_dir, caplog
):
    # At uvicorn's own timeout the streams' tasks were cancelled: the client's connection was cut
    # mid-body with no error event, and the log had an ERROR and a traceback for each.
    handle = start_cluster(one_slow_replica(model_dir))
    body = {"model": model_dir.name, "prompt": [5] * 20, "max_tokens": 1000, "ignore_eos": True}
    try:

        async def stopped_mid_answer() -> tuple[list[str], httpx.Response, int]:
            server_config = ServerConfig(port=0, http_port=0)
            server = await start_server(handle.scheduler, handle.model_info, server_config)
            http = await start_http_server(server.frontend, server_config)
            base_url = f"http://127.0.0.1:{http.port}/v1"
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
                whole = asyncio.ensure_future(client.post("/completions", json=body))
                async with client.stream("POST", "/completions", json={**body, "stream": True}) as stream:
                    lines = stream.aiter_lines()
                    events = [await anext(lines)]  # under way: a minute of tokens to come
                    stopping = asyncio.ensure_future(http.stop(grace_s=0.5))
                    events += [line async for line in lines if line]
                await stopping
                whole = await whole
            await server.stop(grace_s=0)
            return events, whole, await requests_left(handle)

        with caplog.at_level(logging.WARNING):
            events, whole, running = asyncio.run(stopped_mid_answer())
    finally:
        handle.shutdown()

    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["message"] == "the server is shutting down"
    assert all("error" not in json.loads(event.removeprefix("data: ")) for event in events[:-2])
    assert whole.status_code == 503 and whole.json()["error"]["message"] == "the server is shutting down"
    assert running == 0  # aborted, not left to run out their 1000 tokens
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []

@pytest.mark.timing
def test_kvserve_experiment_live_writes_its_files_and_matches_the_simulated_hit_rate(
    ray_cluster, model_dir, vocab_size, tmp_path, capsys
):
    # Multi-turn: each turn's prompt repeats the previous answer, which hits
    # the cache only if the live workers answered with the workload's tokens.
    common = [
        "--workload", "multi_turn", "--workload-arg", "system_prompt_len=32", "--workload-arg", "user_len=16",
        "--workload-arg", "answer_len=8", "--workload-arg", "max_turns=3", "--workload-arg", "think_time=0.5",
        "--replicas", "2", "--num-requests", "16", "--qps", "20", "--policies", "round_robin",
        "--kv-blocks-per-replica", "64", "--cost-model", str(write_cost_model(tmp_path)), "--no-plots",
    ]
    live_out, sim_out = tmp_path / "live", tmp_path / "sim"

    assert run_command([*common, "--live", "--time-scale", "2", "--model", str(model_dir), "--out", str(live_out)]) == 0
    printed = capsys.readouterr()
    assert run_command([*common, "--workload-arg", f"vocab_size={vocab_size}", "--out", str(sim_out)]) == 0

    assert "100% (" in printed.err
    assert "live, simulated replicas" in printed.out
    with open(live_out / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["index"]) for row in rows] == list(range(len(rows)))
    assert sum(int(row["measured"]) for row in rows) == 16
    assert {row["replica_id"] for row in rows} == {"0", "1"}
    assert all(float(row["ttft"]) > 0 for row in rows)
    [live_summary], [sim_summary] = read_summary(live_out), read_summary(sim_out)
    assert live_summary["policy"] == "round_robin"
    assert 0.0 < float(sim_summary["hit_rate"]) < 1.0
    assert float(live_summary["hit_rate"]) == pytest.approx(float(sim_summary["hit_rate"]), rel=TOLERANCE)
    # A live run does not see its replicas' steps: no busy time nor preemptions, where the simulator has them.
    assert live_summary["busy_imbalance"] == ""
    assert float(sim_summary["busy_imbalance"]) >= 1.0
    assert live_summary["num_preemptions"] == "" and sim_summary["num_preemptions"] == "0"
    assert {row["num_preemptions"] for row in rows} == {""}
    assert "|       - |" in (live_out / "summary.md").read_text()
    # The setup printed at the start, then the table's header.
    assert "\n\nmulti_turn (live, simulated replicas)" in (live_out / "summary.md").read_text()


def test_kvserve_experiment_live_at_the_knee_finds_it_by_simulation_and_runs_live_there(
    ray_cluster, model_dir, tmp_path, capsys
):
    out = tmp_path / "knee"
    argv = [
        "--workload", "shared_prefix", "--workload-arg", "num_groups=4", "--workload-arg", "system_prompt_len=64",
        "--workload-arg", "question_len=16", "--workload-arg", "output_len=4", "--workload-arg", "warmup_per_group=0",
        "--replicas", "2", "--num-requests", "24", "--kv-blocks-per-replica", "64", "--qps", "knee", "--knee-factor", "2",
        "--policies", "round_robin", "--cost-model", str(write_cost_model(tmp_path)), "--no-plots",
        "--live", "--time-scale", "2", "--model", str(model_dir), "--out", str(out),
    ]

    assert run_command(argv) == 0
    printed = capsys.readouterr()

    assert "knee: searched for in simulation" in printed.err
    assert "round_robin @ " in printed.err and "100% (24/24 requests" in printed.err
    knee_qps = json.loads((out / "config.json").read_text())["knee_qps"]
    [summary] = read_summary(out)
    assert float(summary["qps"]) == pytest.approx(knee_qps)
    assert "\n\nshared_prefix (live, simulated replicas)" in (out / "summary.md").read_text()


def test_kvserve_experiment_live_says_at_once_when_no_ray_cluster_is_at_the_address(model_dir, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nobody listens here once the socket closes
    # In a process of its own: this one's driver may be connected to the test cluster.
    command = [
        sys.executable, "-m", "kvserve.experiments.experiment", "--workload", "shared_prefix", "--replicas", "2",
        "--num-requests", "8", "--kv-blocks-per-replica", "256", "--qps", "1", "--policies", "round_robin", "--live",
        "--model", str(model_dir),
        "--address", f"127.0.0.1:{port}", "--out", str(tmp_path / "out"), "--no-plots",
    ]
    # ray.init itself retried for over 3 minutes.
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert f"no Ray cluster at 127.0.0.1:{port}: Connection refused" in result.stderr
    assert "Traceback" not in result.stderr


def run_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_experiment_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["experiment", *argv])
    return args.handler(args)


def read_summary(out: Path) -> list[dict[str, str]]:
    with open(out / "summary.csv") as f:
        return list(csv.DictReader(f))


def write_cost_model(directory: Path) -> Path:
    path = directory / "cost_model.json"
    COST_MODEL.save(path)
    return path


def test_requests_of_a_replica_whose_worker_dies_finish_on_the_other_and_it_comes_back(ray_cluster, model_dir):
    """Real Ray: with one request at a time per replica, killing replica 1's worker moves the
    request it runs (resumed after its tokens so far) and the one queued behind it to replica 0;
    replica 1 is started again and rejoins."""
    config = ClusterConfig.from_kwargs(
        str(model_dir),
        parallel=ParallelConfig(tensor_parallel_size=1, num_replicas=2),
        block_size=16,
        num_blocks=64,
        max_num_seqs=1,
        routing="round_robin",
        simulation=SimulationConfig(cost_model=COST_MODEL, time_scale=TIME_SCALE),  # 60 ms steps
    )
    handle = start_cluster(config)
    try:
        scheduler = handle.scheduler
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        specs = [RequestSpec(f"r{k}", [10 + k] * 40, params) for k in range(4)]
        # One call routes them in order (separate calls to the async actor may run out of order).
        replicas = ray.get(scheduler.add_requests.remote(specs), timeout=60)
        assert replicas == [0, 1, 0, 1]  # r2 and r3 wait behind r0 and r1
        ray.kill(ray.get_actor(worker_actor_name(1, 0), namespace=RAY_NAMESPACE))

        last, tokens = {}, {}
        deadline = time.monotonic() + 60
        while len(last) < 4:
            for delta in ray.get(scheduler.poll_outputs.remote(1.0), timeout=60):
                tokens.setdefault(delta.req_id, []).extend(delta.token_ids)
                if delta.is_last:
                    last[delta.req_id] = delta
            assert time.monotonic() < deadline, f"finished only {sorted(last)}"
        while True:
            stats = ray.get(scheduler.get_stats.remote(), timeout=60)
            if all(s.healthy for s in stats):
                break
            assert time.monotonic() < deadline, f"replica 1 not back: {stats}"
            time.sleep(0.1)
    finally:
        handle.shutdown()

    for req_id in ("r0", "r1", "r2", "r3"):
        assert (last[req_id].error, last[req_id].replica, len(tokens[req_id])) == (None, 0, 20), req_id
        assert last[req_id].num_output_tokens == 20
