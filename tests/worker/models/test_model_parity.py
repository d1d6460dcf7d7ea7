"""kvserve's models on the paged KV cache give Hugging Face transformers' logits.

Tiny random models of each family are built with transformers' own config classes and
saved with ``save_pretrained``; kvserve loads them from disk, prefills a batch of prompts
of different lengths through shuffled, non-contiguous block tables, then decodes.
The helpers here are shared with ``test_tensor_parallel``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvserve.kernels import build_attention_metadata
from kvserve.worker.distributed import TensorParallelGroup
from kvserve.worker.model_loader import load_model
from kvserve.worker.models import get_model_class
from kvserve.worker.tiny_model import create_tiny_model

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 64
PROMPT_LENS = (7, 13, 3)
NUM_DECODE_STEPS = 3

_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=128, initializer_range=0.1)
# family -> (config class name, model class name, config kwargs)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        _COMMON, vocab_size=256, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        _COMMON, vocab_size=200, num_key_value_heads=2, head_dim=32, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        _COMMON, vocab_size=251, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        _COMMON, vocab_size=256, num_key_value_heads=2, head_dim=16,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
}


def build_hf_model(family: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A seeded random transformers model; norms and biases are randomized too, so that
    a missed norm weight or bias shows up in the logits."""
    config_name, model_name, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**kwargs, **overrides})
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
    return model


def save_hf_model(family: str, path: Path, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    model = build_hf_model(family, seed, **overrides)
    model.save_pretrained(path)
    return model


def hf_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def make_prompts(vocab_size: int, lens: tuple[int, ...] = PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lens]


class PagedCache:
    """Per-layer (K, V) caches filled with NaN, and shuffled block tables (block 0 unused)."""

    def __init__(self, model: torch.nn.Module, num_reqs: int, max_len: int, seed: int = 0) -> None:
        shape = model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE)
        self.kv_caches = [
            (torch.full(shape, float("nan")), torch.full(shape, float("nan")))
            for _ in range(model.config.num_hidden_layers)
        ]
        block_ids = list(range(1, NUM_BLOCKS))
        random.Random(seed).shuffle(block_ids)
        per_req = -(-max_len // BLOCK_SIZE)
        self.block_tables = [block_ids[i * per_req : (i + 1) * per_req] for i in range(num_reqs)]

    def step(
        self, model: torch.nn.Module, chunks: list[list[int]], num_cached: list[int], req_ids: list[int]
    ) -> list[torch.Tensor]:
        """Run one batch: request ``req_ids[i]`` appends ``chunks[i]`` after ``num_cached[i]``
        cached tokens. Returns the logits of every new token, per request."""
        seq_lens = [c + len(chunk) for c, chunk in zip(num_cached, chunks)]
        metadata = build_attention_metadata(
            [len(c) for c in chunks], seq_lens, [self.block_tables[r] for r in req_ids], BLOCK_SIZE, "cpu"
        )
        input_ids = torch.tensor([t for chunk in chunks for t in chunk])
        positions = torch.tensor([p for c, s in zip(num_cached, seq_lens) for p in range(c, s)])
        with torch.no_grad():
            logits = model.compute_logits(model(input_ids, positions, self.kv_caches, metadata))
        return list(logits.split([len(c) for c in chunks]))


@dataclass
class PagedRun:
    prefill_logits: list[torch.Tensor]  # per prompt: [prompt_len, vocab]
    decode_logits: list[torch.Tensor]  # per step: [num_reqs, vocab]
    sequences: list[list[int]]  # prompts plus the decoded tokens


def run_paged(
    model: torch.nn.Module,
    prompts: list[list[int]],
    num_decode_steps: int = NUM_DECODE_STEPS,
    forced_tokens: list[list[int]] | None = None,
) -> PagedRun:
    """Prefill all prompts in one batch, then decode greedily (or feed ``forced_tokens[step]``)."""
    cache = PagedCache(model, len(prompts), max(map(len, prompts)) + num_decode_steps)
    req_ids = list(range(len(prompts)))
    prefill = cache.step(model, prompts, [0] * len(prompts), req_ids)
    sequences = [list(p) for p in prompts]
    last = torch.stack([logits[-1] for logits in prefill])
    decode_logits = []
    for step in range(num_decode_steps):
        tokens = forced_tokens[step] if forced_tokens else last.argmax(-1).tolist()
        num_cached = [len(s) for s in sequences]
        for seq, token in zip(sequences, tokens):
            seq.append(token)
        last = torch.cat(cache.step(model, [[t] for t in tokens], num_cached, req_ids))
        decode_logits.append(last)
    return PagedRun(prefill, decode_logits, sequences)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_hf_model(request.param, path)
    model = load_model(path, TensorParallelGroup())
    prompts = make_prompts(hf_model.config.vocab_size)
    return hf_model, model, prompts, run_paged(model, prompts)


def test_prefill_logits_match_transformers_at_every_position(family_models) -> None:
    hf_model, _, prompts, run = family_models
    for prompt, logits in zip(prompts, run.prefill_logits):
        torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=ATOL, rtol=0)


def test_decode_logits_match_transformers_on_the_extended_sequence(family_models) -> None:
    hf_model, _, prompts, run = family_models
    for step, step_logits in enumerate(run.decode_logits):
        for req, seq in enumerate(run.sequences):
            context = seq[: len(prompts[req]) + step + 1]
            expected = hf_logits(hf_model, context)[-1]
            torch.testing.assert_close(step_logits[req], expected, atol=ATOL, rtol=0)


def test_decode_feeds_the_argmax_token(family_models) -> None:
    _, _, prompts, run = family_models
    first_tokens = [logits[-1].argmax().item() for logits in run.prefill_logits]
    assert [seq[len(p)] for seq, p in zip(run.sequences, prompts)] == first_tokens


def test_chunked_prefill_mixed_with_decode_matches_transformers(family_models) -> None:
    hf_model, model, prompts, _ = family_models
    a, b = prompts[0], prompts[1]
    cache = PagedCache(model, 2, len(b) + 1, seed=1)
    cache.step(model, [a, b[:5]], [0, 0], [0, 1])
    next_a = hf_logits(hf_model, a)[-1].argmax().item()
    decode_a, chunk_b = cache.step(model, [[next_a], b[5:]], [len(a), 5], [0, 1])
    torch.testing.assert_close(decode_a[0], hf_logits(hf_model, a + [next_a])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(chunk_b, hf_logits(hf_model, b)[5:], atol=ATOL, rtol=0)


def test_registry_maps_architecture_names_to_classes() -> None:
    config = transformers.LlamaConfig(architectures=["MistralForCausalLM"])
    assert get_model_class(config).__name__ == "MistralForCausalLM"


def test_registry_rejects_an_unsupported_architecture() -> None:
    config = transformers.LlamaConfig(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture"):
        get_model_class(config)


def test_mistral_sliding_window_shorter_than_context_is_rejected(tmp_path: Path) -> None:
    save_hf_model("mistral", tmp_path, sliding_window=16)
    with pytest.raises(ValueError, match="sliding_window=16 < max_model_len="):
        load_model(tmp_path, TensorParallelGroup())
    with pytest.raises(ValueError, match="sliding_window=16 < max_model_len=17"):
        load_model(tmp_path, TensorParallelGroup(), max_model_len=17)
    # Sequences no longer than the window: full causal attention is the window's.
    load_model(tmp_path, TensorParallelGroup(), max_model_len=16)


def test_unsupported_rope_type_is_rejected(tmp_path: Path) -> None:
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)
    save_hf_model("llama", tmp_path, rope_parameters=rope)
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        load_model(tmp_path, TensorParallelGroup())


def _edit_checkpoint(path: Path, edit) -> None:
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_weight_is_an_error(tmp_path: Path) -> None:
    save_hf_model("llama", tmp_path)
    _edit_checkpoint(tmp_path, lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing weights.*qkv_proj.weight \(shards \['k'\]\)"):
        load_model(tmp_path, TensorParallelGroup())


def test_unexpected_weight_is_an_error(tmp_path: Path) -> None:
    save_hf_model("llama", tmp_path)
    _edit_checkpoint(tmp_path, lambda w: w.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected weights.*extra"):
        load_model(tmp_path, TensorParallelGroup())


def test_an_index_names_the_files_to_read_and_others_are_left_alone(tmp_path: Path) -> None:
    # Mistral's repositories ship consolidated.safetensors (Mistral's own names)
    # beside the indexed shards: every *.safetensors file was read, and its
    # names were "unexpected weights".
    save_hf_model("llama", tmp_path)
    expected = load_model(tmp_path, TensorParallelGroup())
    weights = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {name: "model-00001-of-00001.safetensors" for name in weights}})
    )
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, tmp_path / "consolidated.safetensors")

    loaded = load_model(tmp_path, TensorParallelGroup())
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), expected.state_dict().values()))

    (tmp_path / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(ValueError, match="names files that are not in .*: model-00001-of-00001.safetensors"):
        load_model(tmp_path, TensorParallelGroup())


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"head_dim": 8}, r"k_proj.weight: shard k: the checkpoint's shape \(32, 64\) does not have the 16 along dimension 0"),
        ({"intermediate_size": 64}, r"down_proj.weight: the checkpoint's shape \(64, 128\) does not have the 64 along dimension 1"),
        ({"num_key_value_heads": 1}, r"k_proj.weight: shard k: the checkpoint's shape \(32, 64\) does not have the 16"),
        ({"num_attention_heads": 2}, r"o_proj.weight: the checkpoint's shape \(64, 64\) does not have the 32 along dimension 1"),
    ],
)
def test_a_config_that_disagrees_with_the_checkpoint_is_an_error(tmp_path: Path, edit, message) -> None:  # noqa: ANN001
    # Each loaded the first rows of the checkpoint's tensors and generated garbage; transformers refuses them.
    create_tiny_model(tmp_path, "llama")  # hidden 64, 4 heads x 16, 2 KV heads, intermediate 128
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path, TensorParallelGroup())


def test_wrongly_shaped_weight_is_an_error(tmp_path: Path) -> None:
    save_hf_model("llama", tmp_path)
    _edit_checkpoint(tmp_path, lambda w: w.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_model(tmp_path, TensorParallelGroup())
