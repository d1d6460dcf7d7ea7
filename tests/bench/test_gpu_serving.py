"""``bench.gpu_serving`` runs end to end on CPU at a tiny scale and prints its tables."""

from __future__ import annotations

import socket
from collections import deque
from types import SimpleNamespace

import pytest

from kvserve.bench import gpu_serving
from kvserve.bench.decode_steps import check_batch_kept, decode_max_tokens, decode_pool_blocks
from kvserve.bench.serving_workloads import make_workloads, model_cost, workload_floor_s
from kvserve.worker.full_size_model import SHAPES
from tests.loopback import free_port


def test_the_cpu_smoke_run_prints_every_part(capsys) -> None:
    # --grpc-port left at 0: part (d) times the port its own server says it listens on.
    assert gpu_serving.main([
        "--device", "cpu", "--parts", "acd", "--batches", "1,3", "--decode-context", "16", "--decode-steps", "2",
        "--scale", "0.03", "--hf-prompts", "2", "--hf-batch", "2",
    ]) == 0
    out = capsys.readouterr().out
    assert "(a) decode step" in out and "|     3 |" in out
    assert "(c) end to end, each run from a cold prefix cache; kvserve: one run per figure (--repeat)" in out
    assert "shared_prefix" in out
    assert "where the plain runs' time went" in out and " decode only |" in out and " with prefill |" in out
    assert "(d) the mixed workload through kvserve serve --device cpu and gRPC: one run" in out and "in-process" in out


def test_decode_rows_measured_before_a_failure_are_printed(monkeypatch, capsys) -> None:  # noqa: ANN001
    def one_row_then_a_preemption(llm, batches, *args):  # noqa: ANN001, ANN202
        yield [batches[0], "1.00", "-", "-", "-", "-"]
        raise RuntimeError("batch 16: preempted")

    monkeypatch.setattr(gpu_serving, "decode_steps", one_row_then_a_preemption)
    with pytest.raises(RuntimeError, match="batch 16: preempted"):
        gpu_serving.main(["--device", "cpu", "--parts", "a", "--batches", "1,16", "--scale", "0.03"])
    assert "|     1 |     1.00 |" in capsys.readouterr().out


def test_the_cpu_pool_holds_the_largest_decode_batch_to_its_last_token() -> None:
    # The default flags: 64 requests of 1,024 tokens outgrew the fixed 4,096-block pool (preempted).
    # Each makes up to 4 x 20 + 8 + 32 = 120 tokens (the last prompts wait 32 prefill steps of 2,048
    # tokens), plus one slot of a step in flight: 1,145 tokens, 72 blocks of 16.
    assert decode_max_tokens(64, 1024, 20, 2048) == 120
    assert decode_pool_blocks((1, 16, 64), 1024, 20, 2048, 16) == 1 + 64 * 72
    # The largest batch sets it, in whatever order the batches come: 256 x 78 blocks (1,241 tokens).
    assert decode_pool_blocks((256, 1, 16, 64), 1024, 20, 2048, 16) == 1 + 256 * 78


def fake_scheduler(running: list[str], waiting: list[str]) -> SimpleNamespace:
    block_pool = SimpleNamespace(num_usable_blocks=4095)
    return SimpleNamespace(running=[SimpleNamespace(req_id=r) for r in running],
                           waiting=deque(SimpleNamespace(req_id=r) for r in waiting),
                           kv_cache_manager=SimpleNamespace(block_pool=block_pool))


def test_a_batch_that_lost_requests_says_how_many_were_preempted_and_how_many_finished() -> None:
    req_ids = ["r0", "r1", "r2", "r3"]
    check_batch_kept(fake_scheduler(req_ids, []), req_ids, num_preemptions=0)
    with pytest.raises(RuntimeError, match=r"batch 4: while its steps were timed, 2 preemptions \(the KV pool holds "
                                           r"4095 usable blocks\); at the end 1 requests were running, 2 preempted "
                                           r"and waiting, 1 finished"):
        check_batch_kept(fake_scheduler(["r0"], ["r1", "r2"]), req_ids, num_preemptions=2)
    # Preempted and running again: the timed steps were not all of the batch.
    with pytest.raises(RuntimeError, match="1 preemptions"):
        check_batch_kept(fake_scheduler(req_ids, []), req_ids, num_preemptions=1)


def test_a_grpc_port_in_use_is_refused_before_any_work(capsys) -> None:  # noqa: ANN001
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            gpu_serving.main(["--device", "cpu", "--parts", "d", "--grpc-port", str(port)])
    assert info.value.code == 2
    assert f"--grpc-port {port}: in use (by a server left running?)" in capsys.readouterr().err
    assert not gpu_serving.port_in_use(free_port())


def test_a_part_this_device_cannot_run_is_named_and_nothing_run_exits_1(capsys) -> None:  # noqa: ANN001
    assert gpu_serving.main(["--device", "cpu", "--parts", "b"]) == 1
    err = capsys.readouterr().err
    assert "part (b), prefill attention, needs a CUDA device: skipped" in err
    assert "nothing of --parts b can run here" in err


def test_the_step_protocol_part_serves_the_mixed_workload_with_in_process_outputs(capsys) -> None:
    # Part (e) alone still runs the mixed workload in-process (plain and async) to compare against;
    # it raises unless the outputs over gRPC equal those token for token.
    assert gpu_serving.main(["--device", "cpu", "--parts", "e", "--scale", "0.03"]) == 0
    out = capsys.readouterr().out
    assert "(e) the mixed workload through the step protocol over gRPC on loopback" in out
    assert "no Ray, no front end, not kvserve serve" in out
    part_e, timeline = out[out.index("(e) the mixed"):].split("where the worker's steps went")

    def table_rows(text: str) -> dict[str, list[str]]:
        cells = [[cell.strip() for cell in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("|")]
        return {row[0]: row[1:] for row in cells[2:]}

    rows = table_rows(part_e)
    assert list(rows) == ["in-process, plain", "step protocol, plain", "in-process, async sched.",
                          "step protocol, async sched., 1 ahead", "step protocol, async sched., 2 ahead"]
    for name in ("plain", "async sched., 1 ahead", "async sched., 2 ahead"):
        _, tok_s, ratio, outputs = rows[f"step protocol, {name}"]
        assert outputs == "equal" and float(tok_s) > 0 and float(ratio) > 0
    # The worker's timeline: every path ran the same plans (one step each per plan with rows),
    # with host times only on CPU.
    steps = table_rows(timeline)
    assert set(steps) == set(rows)
    assert len({row[0] for row in steps.values()}) == 1 and int(next(iter(steps.values()))[0]) > 0
    for steps_, host_ms, between_ms, device_ms, idle_ms, idle_share in steps.values():
        assert float(host_ms) > 0 and float(between_ms) > 0 and device_ms == idle_ms == idle_share == "-"


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


def test_the_launch_profile_names_the_workers_launch_and_what_it_calls(tmp_path) -> None:
    from kvserve import LLM
    from kvserve.bench.decode_steps import _start_decoding, launch_profile
    from kvserve.worker.tiny_model import create_tiny_model

    with LLM(create_tiny_model(tmp_path, "llama", seed=0), num_blocks=64) as llm:
        _start_decoding(llm.engine, 4, 8, 1000, 8, "p", seed=1)
        table = launch_profile(llm.engine, llm.engine.executor.worker, steps=3, top=40)
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in table.splitlines()[2:]}
    launch = next(cells for name, cells in rows.items() if name.startswith("launch (worker.py:"))
    assert int(launch[0]) == 1 and int(launch[1]) >= int(launch[2]) >= 0
    assert any(name.startswith("prepare (input_batch.py:") for name in rows)


def test_the_launch_profile_by_own_time_lists_the_costliest_calls_first(tmp_path) -> None:
    from kvserve import LLM
    from kvserve.bench.decode_steps import _start_decoding, launch_profile
    from kvserve.worker.tiny_model import create_tiny_model

    with LLM(create_tiny_model(tmp_path, "llama", seed=0), num_blocks=64) as llm:
        _start_decoding(llm.engine, 4, 8, 1000, 8, "p", seed=1)
        table = launch_profile(llm.engine, llm.engine.executor.worker, steps=3, top=10, by_own_time=True)
    own = [int(line.split("|")[4]) for line in table.splitlines()[2:]]
    assert len(own) == 10 and own == sorted(own, reverse=True)
