"""``bench.gpu_serving`` runs end to end on CPU at a tiny scale and prints its tables."""

from __future__ import annotations

import socket

import pytest

from kvserve.bench import gpu_serving
from kvserve.bench.serving_workloads import make_workloads, model_cost, workload_floor_s
from kvserve.worker.full_size_model import SHAPES


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_cpu_smoke_run_prints_every_part(capsys) -> None:
    assert gpu_serving.main([
        "--device", "cpu", "--parts", "acd", "--batches", "1,3", "--decode-context", "16", "--decode-steps", "2",
        "--scale", "0.03", "--hf-prompts", "2", "--hf-batch", "2", "--grpc-port", str(free_port()),
    ]) == 0
    out = capsys.readouterr().out
    assert "(a) decode step" in out and "|     3 |" in out
    assert "(c) end to end" in out and "shared_prefix" in out
    assert "(d) the mixed workload through kvserve serve --device cpu and gRPC" in out and "in-process" in out


def test_the_step_protocol_part_serves_the_mixed_workload_with_in_process_outputs(capsys) -> None:
    # Part (e) alone still runs the mixed workload in-process (plain and async) to compare against;
    # it raises unless the outputs over gRPC equal those token for token.
    assert gpu_serving.main(["--device", "cpu", "--parts", "e", "--scale", "0.03"]) == 0
    out = capsys.readouterr().out
    assert "(e) the mixed workload through the step protocol over gRPC on loopback" in out
    assert "no Ray, no front end, not kvserve serve" in out
    table = out[out.index("(e) the mixed"):]
    cells = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table.splitlines() if line.startswith("|")]
    rows = {row[0]: row[1:] for row in cells[2:]}
    assert list(rows) == ["in-process, plain", "step protocol, plain", "in-process, async sched.",
                          "step protocol, async sched."]
    for name in ("plain", "async sched."):
        _, tok_s, ratio, outputs = rows[f"step protocol, {name}"]
        assert outputs == "equal" and float(tok_s) > 0 and float(ratio) > 0


def test_outputs_that_differ_from_in_process_fail_naming_the_request_and_token() -> None:
    gpu_serving.check_same_outputs([[1, 2, 3]], [[1, 2, 3]], "same")
    with pytest.raises(RuntimeError, match="request 1's output differs from in-process's at token 2"):
        gpu_serving.check_same_outputs([[1, 2], [4, 5, 6]], [[1, 2], [4, 5, 7]], "mixed, plain")
    with pytest.raises(RuntimeError, match="1 outputs, expected 2"):
        gpu_serving.check_same_outputs([[1], [2]], [[1]], "mixed, plain")


def test_workloads_have_the_issue_shapes_and_floors_add_up() -> None:
    mixed, long_decode, shared = make_workloads(128256)
    assert len(mixed.prompts) == 256 and all(128 <= len(p) <= 1024 for p in mixed.prompts)
    assert mixed.max_tokens == [128] * 256
    assert len(long_decode.prompts) == 64 and {len(p) for p in long_decode.prompts} == {32}
    assert long_decode.max_tokens == [512] * 64
    assert len(shared.prompts) == 256 and {len(p) for p in shared.prompts} == {1088}
    assert sum(1 for c in shared.cached_tokens if c == 0) == 8 and max(shared.cached_tokens) == 1024

    class Config:
        pass

    config = Config()
    config.__dict__.update(SHAPES["llama-3-8b"][1])
    cost = model_cost(config)
    assert 14.9e9 < cost.weight_bytes < 15.1e9  # 8B parameters less the 1 GB embedding table, in bf16
    assert cost.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    # A decode-only workload's floor is its steps' weight and K/V reads at the read rate.
    floor = workload_floor_s(long_decode, cost, matmul_flops_per_s=float("inf"), read_bytes_per_s=1e12)
    kv_tokens = sum(64 * (32 + step) for step in range(512))
    assert abs(floor - (512 * cost.weight_bytes + kv_tokens * cost.kv_bytes_per_token) / 1e12) < 1e-9
