"""What a model directory says about the model; a broken one is a ValueError that names it."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from kvserve.worker.model_config import ModelConfig
from kvserve.worker.tiny_model import create_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("model-config"), "llama", seed=0)


def test_a_model_directory_gives_its_vocabulary_length_and_eos(model_dir: Path) -> None:
    config = ModelConfig.from_pretrained(model_dir)
    hf = json.loads((model_dir / "config.json").read_text())
    assert (config.vocab_size, config.max_model_len) == (hf["vocab_size"], hf["max_position_embeddings"])
    assert config.architecture == "LlamaForCausalLM" and config.eos_token_ids


@pytest.mark.parametrize(
    "content",
    [
        "{oops",  # not JSON: transformers raised OSError
        json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5}),  # its own error type
    ],
    ids=["not-json", "heads-not-dividing-the-hidden-size"],
)
def test_a_config_that_transformers_cannot_read_is_a_value_error(tmp_path: Path, content: str) -> None:
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=f"{tmp_path}: config.json cannot be read: "):
        ModelConfig.from_pretrained(tmp_path)


def test_a_directory_without_config_json_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a model directory: config.json is missing"):
        ModelConfig.from_pretrained(tmp_path)


def test_the_heads_and_mlp_that_tensor_parallelism_splits_are_read(model_dir: Path) -> None:
    config = ModelConfig.from_pretrained(model_dir)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 128)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "intermediate", "tp", "refused"),
    [
        (4, 2, 128, 1, None),
        (4, 2, 128, 2, None),
        (4, 2, 128, 4, None),  # each KV head on two ranks
        (8, 1, 128, 8, None),  # one KV head everywhere
        (4, 2, 128, 3, "the 4 attention heads and the 2 KV heads (or be a multiple of them) "
                       "and the MLP's intermediate size 128"),
        (4, 2, 128, 8, "the 4 attention heads"),
        (12, 4, 96, 6, "the 4 KV heads (or be a multiple of them)"),  # 6 ranks over 4 KV heads
        (8, 8, 102, 4, "the MLP's intermediate size 102"),
    ],
)
def test_tensor_parallel_sizes_are_checked_as_the_workers_split(
    model_dir: Path, heads: int, kv_heads: int, intermediate: int, tp: int, refused: str | None
) -> None:
    config = dataclasses.replace(
        ModelConfig.from_pretrained(model_dir),
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
    )
    if refused is None:
        config.check_tensor_parallel_size(tp)
    else:
        with pytest.raises(ValueError, match=rf"tensor_parallel_size {tp} cannot split .*: it must divide ") as info:
            config.check_tensor_parallel_size(tp)
        assert str(info.value).endswith(refused)


def test_a_model_without_layers_is_refused(tmp_path: Path) -> None:
    # It failed when the workers sized the KV cache: ZeroDivisionError.
    create_tiny_model(tmp_path, "llama", seed=0, num_hidden_layers=0)
    message = f"{tmp_path}: config has num_hidden_layers=0; a model needs at least one layer"
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(tmp_path)


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Mistral 7B v0.1's shape of config: a 4096-token window under 32768 positions.
    return create_tiny_model(tmp_path_factory.mktemp("windowed"), "mistral", seed=0, sliding_window=64)


def test_a_sliding_window_bounds_the_default_max_model_len(windowed_dir: Path) -> None:
    # Full causal attention equals the window's on sequences no longer than it; the model was refused.
    assert ModelConfig.from_pretrained(windowed_dir).max_model_len == 64
    assert ModelConfig.from_pretrained(windowed_dir, 40).max_model_len == 40


def test_a_max_model_len_past_the_sliding_window_is_refused(windowed_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len must be at most the model's sliding window of 64 tokens, got 65"):
        ModelConfig.from_pretrained(windowed_dir, 65)


def test_capping_max_model_len_to_the_sliding_window_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The context silently shrank from max_position_embeddings to the window.
    path = create_tiny_model(tmp_path / "m", "mistral", seed=0, sliding_window=8, max_position_embeddings=256)
    with caplog.at_level(logging.WARNING, logger="kvserve.worker.model_config"):
        assert ModelConfig.from_pretrained(path).max_model_len == 8
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "max_model_len=8, not max_position_embeddings=256" in message
    assert "context capped to the model's sliding window of 8 tokens: attention here is full causal" in message


def test_no_warning_when_nothing_is_capped(windowed_dir: Path, model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvserve.worker.model_config"):
        ModelConfig.from_pretrained(windowed_dir, 40)  # asked for: within the window
        ModelConfig.from_pretrained(model_dir)  # no window
    assert caplog.records == []


@pytest.mark.parametrize("tp", [0, -2, 2.0, True])
def test_a_tensor_parallel_size_that_is_no_positive_integer_is_refused(model_dir: Path, tp: object) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        ModelConfig.from_pretrained(model_dir).check_tensor_parallel_size(tp)  # type: ignore[arg-type]
