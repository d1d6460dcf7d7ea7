"""Tiny random-weight models: loadable by transformers, deterministic, configurable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvserve import cli
from kvserve.worker.model_config import ModelConfig
from kvserve.worker.tiny_model import (
    FAMILIES,
    FORMAT_FILE,
    create_tiny_model,
    default_tiny_model_path,
    ensure_default_tiny_model,
)

MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}
MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
TEXTS = [
    "The lighthouse keeper wrote it down.",
    "  leading spaces, trailing tabs\t\n\nand blank lines\r\n",
    "def f(x: int) -> int:\n    return x ** 2 + 3.14159  # café, naïve, 東京",
    "2019-04-01 06:00 1012.6 hPa, 18446744073709551615 and -0.30000000000000004",
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: create_tiny_model(root / family, family, seed=0) for family in FAMILIES}


def safetensors_keys(path: Path) -> set[str]:
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return set(f.keys())


def dir_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_writes_a_directory_that_transformers_loads(model_dirs: dict[str, Path], family: str) -> None:
    path = model_dirs[family]
    assert {p.name for p in path.iterdir()} == MODEL_FILES
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)

    assert type(model).__name__ == MODEL_CLASSES[family]
    config = model.config
    assert config.model_type == family
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (64, 2, 128)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.max_position_embeddings == 2048
    assert config.rms_norm_eps == 1e-6
    assert config.vocab_size == len(tokenizer) == 1000
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tokenizer.is_fast
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<s>", 0)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("</s>", 1)
    assert (config.bos_token_id, config.eos_token_id) == (0, 1)
    assert model.generation_config.eos_token_id == 1
    assert model.generation_config.do_sample is False


def test_qwen2_has_qkv_bias_and_llama_has_none(model_dirs: dict[str, Path]) -> None:
    qwen2_keys = safetensors_keys(model_dirs["qwen2"])
    assert {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"} <= qwen2_keys
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2_keys
    assert not any(key.endswith(".bias") for key in safetensors_keys(model_dirs["llama"]))


def test_qwen3_has_per_head_qk_norms(model_dirs: dict[str, Path]) -> None:
    with safe_open(model_dirs["qwen3"] / "model.safetensors", framework="pt") as f:
        q_norm = f.get_tensor("model.layers.1.self_attn.q_norm.weight")
        k_norm = f.get_tensor("model.layers.1.self_attn.k_norm.weight")
    assert q_norm.shape == k_norm.shape == (16,)
    # Random, not all ones, so that a swapped or missing norm changes outputs.
    assert not torch.equal(q_norm, k_norm)
    assert q_norm.min() >= 0.5 and q_norm.max() <= 1.5


def test_same_arguments_give_byte_identical_files(tmp_path: Path) -> None:
    first = create_tiny_model(tmp_path / "a", "qwen2", seed=7, num_hidden_layers=1)
    second = create_tiny_model(tmp_path / "b", "qwen2", seed=7, num_hidden_layers=1)
    assert dir_bytes(first) == dir_bytes(second)


def test_different_seeds_give_different_weights(tmp_path: Path) -> None:
    first = create_tiny_model(tmp_path / "a", seed=0, num_hidden_layers=1)
    second = create_tiny_model(tmp_path / "b", seed=1, num_hidden_layers=1)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    assert (first / "model.safetensors").read_bytes() != (second / "model.safetensors").read_bytes()


def test_creation_leaves_global_rng_untouched(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    create_tiny_model(tmp_path / "m", num_hidden_layers=1)
    assert torch.equal(torch.rand(4), expected)


def test_config_overrides_are_honoured(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 500000.0,
    }
    path = create_tiny_model(
        tmp_path / "m",
        "llama",
        num_hidden_layers=3,
        num_key_value_heads=4,
        vocab_size=1024,
        rope_parameters=rope,
    )
    config = AutoConfig.from_pretrained(path)
    assert (config.num_hidden_layers, config.num_key_value_heads, config.vocab_size) == (3, 4, 1024)
    assert config.rope_parameters == rope
    keys = safetensors_keys(path)
    assert "model.layers.2.self_attn.k_proj.weight" in keys
    assert "model.layers.3.self_attn.k_proj.weight" not in keys


def test_legacy_rope_scaling_key_becomes_rope_parameters(tmp_path: Path) -> None:
    path = create_tiny_model(tmp_path / "m", "qwen3", rope_scaling={"rope_type": "linear", "factor": 2.0})
    saved = json.loads((path / "config.json").read_text())
    assert saved["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


def test_a_model_with_several_eos_tokens_lists_each_and_pads_with_the_first(tmp_path: Path) -> None:
    # Llama 3 instruct's shape of config; creating it raised a TypeError in transformers.
    path = create_tiny_model(tmp_path / "m", eos_token_id=[1, 2])
    generation = json.loads((path / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == ([1, 2], 1)
    assert ModelConfig.from_pretrained(path).eos_token_ids == (1, 2)


def test_tied_embeddings_store_one_matrix(tmp_path: Path) -> None:
    path = create_tiny_model(tmp_path / "m", "qwen2", tie_word_embeddings=True)
    assert "lm_head.weight" not in safetensors_keys(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.tie_word_embeddings is True
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_untied_model_stores_lm_head(model_dirs: dict[str, Path]) -> None:
    assert "lm_head.weight" in safetensors_keys(model_dirs["mistral"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"family": "gpt2"}, "family must be one of"),
        ({"attention_bias": False, "family": "qwen2"}, r"Qwen2Config has no field\(s\) \['attention_bias'\]"),
        ({"num_hiden_layers": 3}, "has no field"),
        ({"vocab_size": 999}, "vocab_size must be at least"),
        ({"seed": 1.5}, "seed must be an integer"),
    ],
)
def test_rejects_bad_arguments(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        create_tiny_model(tmp_path / "m", **kwargs)


def test_refuses_to_write_into_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError):
        create_tiny_model(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tokenizer_round_trips_text_and_agrees_with_tokenizer_json(
    model_dirs: dict[str, Path], family: str
) -> None:
    # NOTE: AutoTokenizer picks Qwen2Tokenizer for qwen2, which rebuilds its own
    # pre-tokenizer; the ids must still be those of tokenizer.json.
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[family])
    raw = Tokenizer.from_file(str(model_dirs[family] / "tokenizer.json"))
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert ids == raw.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert max(ids) < 1000


def test_digits_are_tokenized_one_at_a_time(model_dirs: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
    assert tokenizer.tokenize("2048") == ["2", "0", "4", "8"]


@pytest.mark.parametrize(("family", "tie"), [("llama", False), ("qwen3", True)])
def test_greedy_generation_is_varied(tmp_path: Path, family: str, tie: bool) -> None:
    path = create_tiny_model(tmp_path / "m", family, tie_word_embeddings=tie)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for prompt in ["The lighthouse keeper", "def f(x):", "In 2019 the weather was"]:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        output = model.generate(input_ids, max_new_tokens=16, do_sample=False)
        new_ids = output[0, input_ids.shape[1] :].tolist()
        assert len(set(new_ids)) >= 6, (prompt, new_ids)


def test_default_path_follows_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    assert default_tiny_model_path() == tmp_path / "models" / "tiny-llama"
    monkeypatch.delenv("KVSERVE_CACHE_DIR")
    assert default_tiny_model_path() == Path.home() / ".cache" / "kvserve" / "models" / "tiny-llama"
    assert default_tiny_model_path(tmp_path / "c") == tmp_path / "c" / "models" / "tiny-llama"


def test_ensure_default_creates_once_and_atomically(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    path = ensure_default_tiny_model()
    assert path == tmp_path / "models" / "tiny-llama"
    assert {p.name for p in path.iterdir()} == MODEL_FILES | {FORMAT_FILE}
    assert [p.name for p in path.parent.iterdir()] == ["tiny-llama"]  # no temporary directory left
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"

    mtime_ns = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_tiny_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime_ns


def test_ensure_default_keeps_the_winner_of_a_race(tmp_path: Path) -> None:
    winner = ensure_default_tiny_model(tmp_path)
    marker = winner / "written-by-winner"
    marker.touch()
    # The loser finds the directory in place before creating anything.
    assert ensure_default_tiny_model(tmp_path) == winner
    assert marker.exists()


def test_a_default_model_cached_by_an_older_kvserve_is_written_anew(tmp_path: Path) -> None:
    # A copy from before the chat template (no format file): the OpenAI chat API refused it.
    stale = create_tiny_model(default_tiny_model_path(tmp_path), "llama", seed=0)
    config_path = stale / "tokenizer_config.json"
    config_path.write_text(json.dumps({k: v for k, v in json.loads(config_path.read_text()).items()
                                       if k != "chat_template"}))
    (stale / "left-by-the-old-copy").touch()

    path = ensure_default_tiny_model(tmp_path)
    assert path == stale
    assert {p.name for p in path.iterdir()} == MODEL_FILES | {FORMAT_FILE}
    assert [p.name for p in path.parent.iterdir()] == ["tiny-llama"]  # the stale copy and staging are gone
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<s><|user|>hi\n"
    mtime_ns = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_tiny_model(tmp_path) == path  # current now: left as it is
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime_ns


def test_a_worker_actor_on_another_node_creates_the_default_model_the_front_end_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # `kvserve serve` without --model creates the model on its own node and
    # passes the path; a KubeRay worker pod found nothing there and failed.  The
    # cluster's worker actor writes the node's copy; a Worker never writes a model.
    import asyncio

    import ray.util

    from kvserve.cluster.worker_actor import WorkerActor
    from kvserve.worker.worker import Worker
    from kvserve.worker.worker_config import WorkerConfig

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    path = default_tiny_model_path()
    config = WorkerConfig(str(path), device="cpu", num_blocks=8, attention_backend="torch")
    with pytest.raises(OSError):
        Worker(config)
    assert not path.exists()

    actor = WorkerActor(replica_id=0, rank=0)

    async def start_and_stop() -> str:
        address = await actor.start(config, secret="a-secret-of-this-test")
        await actor._server.stop(grace=None)  # noqa: SLF001
        return address

    assert asyncio.run(start_and_stop()).startswith("127.0.0.1:")
    assert (path / "config.json").is_file() and actor._worker.hf_config.model_type == "llama"  # noqa: SLF001
    actor._thread.shutdown()  # noqa: SLF001
    # Any other missing directory is still an error: nothing is created there.
    other = WorkerActor(replica_id=0, rank=0)
    with pytest.raises(OSError):
        asyncio.run(other.start(
            WorkerConfig(str(tmp_path / "models" / "other"), device="cpu", num_blocks=8, attention_backend="torch"),
            secret="a-secret-of-this-test"))
    other._thread.shutdown()  # noqa: SLF001
    assert not (tmp_path / "models" / "other").exists()


def test_cli_lists_every_family() -> None:
    assert set(cli._FAMILIES) == set(FAMILIES)


def test_cli_help_names_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["create-tiny-model", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--family {llama,mistral,qwen2,qwen3}" in help_text
    assert "--seed" in help_text


def test_cli_creates_a_model_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["create-tiny-model", str(tmp_path / "m"), "--family", "mistral", "--seed", "3"])
    assert status == 0
    assert "created tiny mistral model" in capsys.readouterr().out
    expected = create_tiny_model(tmp_path / "expected", "mistral", seed=3)
    assert dir_bytes(tmp_path / "m") == dir_bytes(expected)


def test_cli_reports_a_non_empty_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keep.txt").write_text("precious")
    assert cli.main(["create-tiny-model", str(tmp_path)]) == 2
    assert "not an empty directory" in capsys.readouterr().err


def test_cli_reports_a_path_under_a_file_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # An OSError from making the directory was a traceback, exit status 1.
    (tmp_path / "file").write_text("")
    assert cli.main(["create-tiny-model", str(tmp_path / "file" / "model")]) == 2
    assert capsys.readouterr().err == f"kvserve create-tiny-model: error: {tmp_path / 'file' / 'model'}: Not a directory\n"


def test_cli_reports_a_file_in_the_way(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model").write_text("precious")
    assert cli.main(["create-tiny-model", str(tmp_path / "model")]) == 2
    assert f"{tmp_path / 'model'} is a file, not a directory" in capsys.readouterr().err
    assert (tmp_path / "model").read_text() == "precious"


def test_cli_runs_as_a_module(tmp_path: Path) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    command = ["-m", "kvserve.cli", "create-tiny-model", str(tmp_path / "m"), "--family", "qwen3"]
    result = subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert dir_bytes(tmp_path / "m") == dir_bytes(create_tiny_model(tmp_path / "expected", "qwen3"))
