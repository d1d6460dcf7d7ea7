"""bench.layer_ops's table and its refusal without a GPU (its figures come from a GPU run)."""

from __future__ import annotations

import pytest
import torch

from kvserve.bench import layer_ops


def test_table_has_a_row_per_op_and_token_count_with_each_implementation():
    def rows(scale):
        return [{"op": op, "tokens": tokens, "host_us": 10.0 * scale, "device_us": 2.5 * scale}
                for tokens in layer_ops.TOKENS for op in ("add + RMSNorm", "SiLU-and-mul")]

    table = layer_ops.layer_ops_table({"cuda": rows(1), "triton": rows(4)})
    lines = table.splitlines()
    assert [cell.strip() for cell in lines[0].split("|")[1:-1]] == [
        "op", "tokens", "cuda host us", "triton host us", "cuda device us", "triton device us"]
    body = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[2:]]
    assert len(body) == 2 * len(layer_ops.TOKENS)
    assert body[0] == ["add + RMSNorm", "64", "10.0", "40.0", "2.5", "10.0"]
    assert {row[1] for row in body} == {str(tokens) for tokens in layer_ops.TOKENS}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_main_says_it_needs_a_gpu(capsys):
    assert layer_ops.main([]) == 1
    assert "no CUDA device" in capsys.readouterr().err
