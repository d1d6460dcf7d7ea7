"""``bench.faults`` on a real local cluster: a killed worker loses no stream and leaks no block; fuzzed
requests are all refused clearly; a killed scheduler ends every stream and the server with it."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import grpc
import pytest

from kvserve.bench.fault_fuzz import scenario_fuzz
from kvserve.bench.fuzzed_requests import FuzzedRequests
from kvserve.bench.fault_scheduler_kill import scenario_scheduler_kill
from kvserve.bench.serve_process import ServeProcess, serve_args
from kvserve.cluster.frontend import SCHEDULER_LOST
from kvserve.proto import generate_pb2, generate_pb2_grpc
from kvserve.worker.model_config import ModelConfig
from kvserve.worker.tiny_model import create_tiny_model


@pytest.mark.timing
@pytest.mark.slow
def test_a_killed_worker_loses_no_stream_and_cancels_leave_no_block() -> None:
    # Its own process: the benchmark starts (and stops) a Ray instance of its own.  Streams of 32
    # tokens: with 8, on a loaded machine (the suite on two workers) the killed replica's streams
    # could all end before the kill landed, leaving none to move.
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.bench.faults", "--streams", "9", "--max-tokens", "32", "--scenarios", "ac"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in result.stdout.splitlines() if line.startswith("|") and ". " in line}
    sent, correct, moved, ended, blocks, recovery = rows["a. kill a worker rank"][:6]
    assert (sent, correct, ended, blocks) == ("9", "9", "OK 9", "0")
    assert int(moved) >= 1 and float(recovery) < 60, result.stdout[-3000:]
    sent, correct, _, ended, blocks = rows["c. cancels and deadlines"][:5]
    assert blocks == "0" and int(correct) == sum(int(part.split()[1]) for part in ended.split(", ") if part.startswith("OK"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("faults-model"), "llama", seed=0)


def served(model_dir: Path) -> ServeProcess:
    """``kvserve serve`` of one replica (TP 1) on CPU, in a session (and a Ray instance) of its own."""
    return ServeProcess(serve_args(model_dir, num_replicas=1, tp_size=1, num_blocks=512, max_concurrent_requests=256))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(8, 64))] for _ in range(n)]


async def fuzz(port: int, serve: ServeProcess, model_dir: Path, num_requests: int):
    model = ModelConfig.from_pretrained(model_dir)
    requests = FuzzedRequests(0, prompts(1, seed=1)[0], model.vocab_size, model.max_model_len)
    rows, outcome = await scenario_fuzz(
        f"127.0.0.1:{port}", requests, prompts(4), max_tokens=8, num_requests=num_requests,
        server_alive=lambda: serve.proc.poll() is None,
    )
    return {row.name.split(": ")[1]: row for row in rows}, outcome, requests


def test_every_field_of_a_generate_request_is_fuzzed() -> None:
    # A field added to the API gets fuzz cases too; seed and ignore_eos have no bad values, only odd ones.
    requests = FuzzedRequests(0, [5, 6, 7], vocab_size=1000, max_model_len=2048)
    fuzzed = {kind.split()[0].rstrip(":") for kind in [*requests.bad, *requests.odd]}
    fields = {f.name for message in (generate_pb2.GenerateRequest, generate_pb2.SamplingParams)
              for f in message.DESCRIPTOR.fields}
    assert fields - fuzzed == set()


@pytest.fixture(scope="module")
def fuzzed_then_killed(model_dir: Path):
    """One server (each start is a Ray instance's, some 10 s): fuzzed first, then its scheduler killed
    under long streams."""
    async def kill(port: int, serve: ServeProcess):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            # Long streams: every one still runs when the scheduler dies.
            return await scenario_scheduler_kill(
                serve, channel, generate_pb2_grpc.GenerationStub(channel), prompts(6), max_tokens=400
            )

    with served(model_dir) as serve:
        port = serve.wait_for_port()
        fuzzed = asyncio.run(fuzz(port, serve, model_dir, num_requests=100))
        killed = asyncio.run(kill(port, serve))
    return fuzzed, killed


@pytest.mark.timing
@pytest.mark.slow
def test_every_fuzzed_bad_request_is_refused_clearly_and_the_server_still_serves_good_ones(fuzzed_then_killed) -> None:
    (rows, outcome, requests), _ = fuzzed_then_killed

    assert outcome.server_alive
    # Every kind of bad and odd request was sent at least once (each kind comes once before the random draws).
    assert {ending.kind for ending in outcome.endings} == set(requests.bad) | set(requests.odd)
    # INVALID_ARGUMENT, naming what is wrong; a message over the size limit is gRPC's own RESOURCE_EXHAUSTED.
    refused_otherwise = [
        (e.kind, e.result.code, e.result.details) for e in outcome.bad()
        if e.result.code != ("RESOURCE_EXHAUSTED" if e.kind == "text over the message limit" else "INVALID_ARGUMENT")
    ]
    assert refused_otherwise == []
    # Odd but valid requests (unknown fields, extreme seeds on greedy requests) are served as their plain form.
    odd = rows["odd, valid requests"]
    assert odd.correct == odd.sent and odd.codes == Counter({"OK": odd.sent})
    good = rows["good streams"]
    assert good.correct == good.sent and good.codes == Counter({"OK": good.sent})
    assert good.blocks_in_use == 0


@pytest.mark.timing
@pytest.mark.slow
def test_a_killed_scheduler_ends_every_stream_and_serve_exits_non_zero_without_saying_serving(
    fuzzed_then_killed,
) -> None:
    # The exit itself (code 1, the message, nothing left) with no stream running: tests/cluster/test_cli.py.
    _, (scenario, outcome) = fuzzed_then_killed

    assert outcome.exit_code == 1
    assert outcome.exit_s is not None and outcome.exit_s < 30.0
    assert "the scheduler actor died" in (outcome.error_line or "")
    # Health stops saying SERVING as soon as the server notices (NOT_SERVING, or the port already
    # closed), and never says it again.
    assert outcome.first_not_serving_s is not None and outcome.first_not_serving_s < 5.0
    assert not outcome.serving_again
    assert outcome.processes_left == []
    # Every stream ends with UNAVAILABLE and words for clients, not a reset connection.
    assert scenario.codes == Counter({"UNAVAILABLE": 6}), scenario.notes
    assert f"{scenario.name}: 6 stream(s) ended with: {SCHEDULER_LOST}" in scenario.notes
