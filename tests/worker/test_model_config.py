"""What a model directory says about the model; a broken one is a ValueError that names it."""

from __future__ import annotations

import json
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
