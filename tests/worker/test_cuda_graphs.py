"""Decode steps through CUDA graphs: batch sizes, padding, and static buffers equal to a rebuild.

On CPU the buffers are filled as on a GPU (without pinned memory), so what a graph
would read is checked against what the eager path builds from scratch for the
same plan.  Capture and replay themselves are ``gpu`` tests.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvserve.kernels import build_attention_metadata
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes, padded_batch_size
from kvserve.worker.input_batch import InputBatch

CPU = torch.device("cpu")


def test_batch_sizes_are_powers_of_two_then_multiples_of_eight() -> None:
    assert graph_batch_sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert graph_batch_sizes(3) == (1, 2, 4)
    assert graph_batch_sizes(1) == (1,)
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)


def test_a_batch_pads_to_the_smallest_size_that_holds_it() -> None:
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert padded_batch_size(65, sizes) is None


def run_scheduler(batch: InputBatch, on_decode_step, *, num_requests: int = 12, num_blocks: int = 60) -> int:
    """Drive a scheduler (with preemption: few blocks) through ``batch``; call back on decode-only steps."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16, max_model_len=256),
        CacheConfig(block_size=4, num_blocks=num_blocks),
    )
    rng = random.Random(3)
    for i in range(num_requests):
        prompt = [rng.randrange(3, 100) for _ in range(rng.randrange(2, 30))]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(5, 25), ignore_eos=True)))
    decode_steps = 0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        batch.apply(plan)
        if plan.req_ids:
            decode = batch.prepare_decode(plan)
            if decode is not None:
                on_decode_step(plan, decode, scheduler)
                decode_steps += 1
        scheduler.update(plan, [rng.randrange(3, 100) for _ in range(plan.num_sampled)])
    return decode_steps


def test_device_block_table_equals_the_host_table_after_every_plan() -> None:
    batch = InputBatch(block_size=4, device=CPU, initial_rows=2, max_blocks_per_req=64)

    def check(plan, decode, scheduler) -> None:
        for req_id in plan.req_ids:
            row = batch.requests[req_id].row
            num_blocks = int(batch.num_blocks[row])
            assert batch.device_block_table.table[row, :num_blocks].tolist() == scheduler.kv_cache_manager.get_block_ids(req_id)

    assert run_scheduler(batch, check) > 20


def test_static_buffers_hold_what_the_eager_path_builds_plus_inert_padding() -> None:
    batch = InputBatch(block_size=4, device=CPU, max_blocks_per_req=64)
    graphs = DecodeGraphs(
        lambda *args: None, batch.device_block_table, batch_sizes=graph_batch_sizes(16), max_seq_len=256,
        block_size=4, device=CPU,
    )
    padded_sizes = set()

    def check(plan, decode, scheduler) -> None:
        eager = batch.prepare(plan)
        n = len(plan.req_ids)
        size = padded_batch_size(n, graphs.batch_sizes)
        padded_sizes.add(size)
        graphs.load(decode, size)
        assert graphs.input_ids[:n].tolist() == eager.input_ids.tolist()
        assert graphs.positions[:n].tolist() == eager.positions.tolist()
        assert graphs.slot_mapping[:n].tolist() == eager.attn_metadata.slot_mapping.tolist()
        assert graphs.seq_lens[:n].tolist() == eager.attn_metadata.seq_lens.tolist()
        width = eager.attn_metadata.block_tables.shape[1]
        for i in range(n):
            num_blocks = -(-int(eager.attn_metadata.seq_lens[i]) // 4)
            assert graphs.block_tables[i, :num_blocks].tolist() == eager.attn_metadata.block_tables[i, :num_blocks].tolist()
        assert width <= graphs.block_tables.shape[1]
        # Padding rows write nowhere and read one key of a real block.
        assert graphs.slot_mapping[n:size].tolist() == [-1] * (size - n)
        assert graphs.seq_lens[n:size].tolist() == [1] * (size - n)
        assert graphs.input_ids[n:size].tolist() == [0] * (size - n)
        assert np.array_equal(decode.logits_indices, eager.logits_indices.numpy())
        assert decode.output_indices == eager.output_indices
        metadata = graphs.metadata(size, decode.seq_lens.tolist() + [1] * (size - n))
        assert metadata.query_start_loc.tolist() == list(range(size + 1))
        assert not metadata.captured
        # A capture's host copies are bounds: the kernels then size each request's splits on the device.
        capture = graphs.metadata(size)
        assert capture.captured and capture.seq_lens_cpu == (graphs.max_seq_len,) * size

    assert run_scheduler(batch, check) > 20
    assert len(padded_sizes) > 2


def test_a_step_with_a_prompt_chunk_is_not_a_decode_step() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=4, num_blocks=32))
    batch = InputBatch(block_size=4, device=CPU, max_blocks_per_req=16)
    scheduler.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=4)))
    plan = scheduler.schedule()
    batch.apply(plan)
    assert batch.prepare_decode(plan) is None
    scheduler.update(plan, [9])
    plan = scheduler.schedule()
    batch.apply(plan)
    decode = batch.prepare_decode(plan)
    assert decode is not None and decode.positions.tolist() == [3] and decode.seq_lens.tolist() == [4]


def test_a_request_longer_than_the_device_table_is_refused() -> None:
    batch = InputBatch(block_size=4, device=CPU, max_blocks_per_req=2)
    with pytest.raises(ValueError, match="more than 2 blocks"):
        batch.device_block_table.write(np.array([0]), np.array([2]), np.array([7]))


@pytest.mark.gpu
@pytest.mark.parametrize("length", [40, 1500])
def test_graphed_decode_logits_equal_eager_ones_within_bf16_tolerance(tmp_path, length: int) -> None:
    # 1,500-token contexts span several of the splits planned at capture for 2,048.
    from kvserve import LLM
    from kvserve.worker.input_batch import DecodeBatch
    from kvserve.worker.tiny_model import create_tiny_model

    path = create_tiny_model(tmp_path / "m", "llama", seed=3, head_dim=128, num_attention_heads=8,
                             num_key_value_heads=2, hidden_size=256, intermediate_size=512)
    n, block_size = 5, 16
    per_req = -(-(length + 1) // block_size)
    with LLM(path, device="cuda", dtype="bfloat16", num_blocks=512, max_num_seqs=16,
             max_model_len=2048) as llm:
        worker = llm.engine.executor.worker
        assert worker.decode_graphs is not None and worker.decode_graphs.num_graphs == 5
        tables = [list(range(1 + per_req * r, 1 + per_req * (r + 1))) for r in range(n)]
        generator = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            prompt_ids = torch.randint(3, 900, (n * length,), generator=generator).cuda()
            prompt_positions = torch.arange(length).repeat(n).cuda()
            worker._forward(prompt_ids, prompt_positions,
                            build_attention_metadata([length] * n, [length] * n, tables, block_size, "cuda"))
            next_ids = torch.randint(3, 900, (n,), generator=generator)
            eager = worker._forward(next_ids.cuda(), torch.full((n,), length, device="cuda"),
                                    build_attention_metadata([1] * n, [length + 1] * n, tables, block_size, "cuda"))
            eager_logits = worker.model.compute_logits(eager)
            rows = np.arange(n, dtype=np.int64)
            columns = np.tile(np.arange(per_req), n)
            worker.input_batch.device_block_table.write(np.repeat(rows, per_req), columns,
                                                        np.array(tables, dtype=np.int32).ravel())
            positions = np.full(n, length, dtype=np.int64)
            decode = DecodeBatch(
                input_ids=next_ids.numpy(), positions=positions,
                slot_mapping=np.array([t[length // block_size] * block_size + length % block_size for t in tables]),
                seq_lens=np.full(n, length + 1, dtype=np.int32), rows=rows, logits_indices=rows,
                sampling_params=[], output_indices=[],
            )
            size = worker.decode_graphs.padded_size(decode)
            assert size == 8
            graphed_logits = worker.model.compute_logits(worker.decode_graphs.run(decode, size))
        torch.testing.assert_close(graphed_logits, eager_logits, rtol=0.05, atol=0.05)
        assert (graphed_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean() >= 0.8
