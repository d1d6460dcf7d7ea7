"""Full-size random checkpoints: a published model's shape, sharded like the hub's, loadable by
transformers and by kvserve, which generate the same tokens from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from kvserve import LLM, SamplingParams
from kvserve.worker.full_size_model import SHAPES, create_full_size_model
from tests.engine.hf_reference import hf_greedy, load_hf_model
from tests.engine.test_llm_parity import random_prompts

# The published widths shrunk so that a CPU test runs in seconds; the shape's other fields stay.
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=4096)


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for file_name in sorted(set(index["weight_map"].values())):
        with safe_open(path / file_name, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


@pytest.mark.parametrize("shape", ["llama-3-8b", "qwen2.5-7b"])
def test_the_config_is_the_published_models(tmp_path: Path, shape: str) -> None:
    path = create_full_size_model(tmp_path / "m", shape, num_hidden_layers=1, vocab_size=1024,
                                  intermediate_size=64)
    config = AutoConfig.from_pretrained(path)
    family, fields = SHAPES[shape]
    assert config.model_type == family
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(config, key) == fields[key], key
    assert (config.num_hidden_layers, config.vocab_size, config.intermediate_size) == (1, 1024, 64)


def test_shards_hold_every_weight_once_in_bfloat16_under_the_limit(tmp_path: Path) -> None:
    path = create_full_size_model(tmp_path / "m", "llama-3-8b", shard_bytes=3 << 20, **SMALL)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    assert files == sorted(p.name for p in path.glob("*.safetensors"))
    tensors = checkpoint_tensors(path)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    embedding = tensors["model.embed_tokens.weight"]
    for file_name in files:
        size = (path / file_name).stat().st_size
        # Only a file holding one tensor bigger than the limit may exceed it (by its header).
        assert size <= 3 << 20 or index["weight_map"]["model.embed_tokens.weight"] == file_name
    assert embedding.shape == (4096, 256)
    assert abs(embedding.float().std().item() - 0.02) < 0.002
    assert torch.equal(tensors["model.norm.weight"], torch.ones(256, dtype=torch.bfloat16))


def test_weights_depend_on_the_seed_only(tmp_path: Path) -> None:
    first = checkpoint_tensors(create_full_size_model(tmp_path / "a", "llama-3-8b", seed=3, **SMALL))
    again = checkpoint_tensors(create_full_size_model(tmp_path / "b", "llama-3-8b", seed=3, **SMALL))
    other = checkpoint_tensors(create_full_size_model(tmp_path / "c", "llama-3-8b", seed=4, **SMALL))
    name = "model.layers.1.mlp.down_proj.weight"
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first[name], other[name])


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "qwen2.5-7b"])
def test_kvserve_generates_what_transformers_generates(tmp_path: Path, shape: str) -> None:
    # llama-3.2-1b ties its embeddings; qwen2.5-7b has q/k/v biases.
    path = create_full_size_model(tmp_path / "m", shape, **SMALL)
    prompts = random_prompts(3, seed=1)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(path, dtype="float32", device="cpu", num_blocks=64)
    try:
        tokens = [out.token_ids for out in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
    assert tokens == hf_greedy(load_hf_model(path), prompts, params.max_tokens)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float16"}, "dtype must be a floating-point torch.dtype"),
        ({"dtype": torch.int8}, "dtype must be a floating-point torch.dtype"),
        ({"seed": "a"}, "seed must be an integer"),
        ({"shard_bytes": 0}, "shard_bytes must be a positive integer"),
        ({"hidden_sizes": 3}, "no field"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
        ({"num_attention_heads": 3, "head_dim": None}, "the config does not fit together"),
    ],
)
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        create_full_size_model(tmp_path / "m", "llama-3-8b", **{**SMALL, **kwargs})
    assert not (tmp_path / "m").exists()


def test_a_failed_write_leaves_nothing_and_a_retry_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It left config and tokenizer files without weights, and the retry was refused.
    from kvserve.worker import full_size_model

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(full_size_model, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        create_full_size_model(tmp_path / "m", "llama-3-8b", **SMALL)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert (create_full_size_model(tmp_path / "m", "llama-3-8b", **SMALL) / "model.safetensors.index.json").is_file()


def test_unknown_shapes_and_occupied_paths_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shape must be one of"):
        create_full_size_model(tmp_path / "m", "llama-70b")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError):
        create_full_size_model(tmp_path / "full", "llama-3-8b", **SMALL)
