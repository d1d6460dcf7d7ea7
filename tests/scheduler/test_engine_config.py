"""The engine's settings tree: one definition that LLM's keywords, ClusterConfig and serve's
flags all map onto."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.scheduler.engine_config import (
    CacheSettings,
    EngineConfig,
    ParallelConfig,
    RuntimeSettings,
    SchedulerSettings,
)


def test_flat_settings_land_in_their_groups_and_the_rest_keep_their_defaults() -> None:
    config = EngineConfig.from_kwargs("/m", block_size=32, max_num_seqs=8, dtype="float32", tensor_parallel_size=2)
    assert config.cache == CacheSettings(block_size=32)
    assert config.scheduler == SchedulerSettings(max_num_seqs=8)
    assert config.runtime == RuntimeSettings(dtype="float32")
    assert config.parallel == ParallelConfig(tensor_parallel_size=2)
    assert EngineConfig.from_kwargs("/m") == EngineConfig("/m")
    # a whole group by its name, but not a group and one of its settings
    assert EngineConfig.from_kwargs("/m", parallel=ParallelConfig(num_replicas=3)).parallel.num_replicas == 3
    with pytest.raises(TypeError, match="num_replicas is set both by name and in the parallel group"):
        EngineConfig.from_kwargs("/m", parallel=ParallelConfig(), num_replicas=3)


def test_every_setting_is_defined_by_exactly_one_group() -> None:
    names = EngineConfig.field_names()
    defined = [f.name for group in (CacheSettings, SchedulerSettings, RuntimeSettings, ParallelConfig)
               for f in dataclasses.fields(group)]
    assert sorted(defined) == sorted(names) and len(set(defined)) == len(defined)
    for name in names:
        group = getattr(EngineConfig("/m"), EngineConfig.field_group(name))
        assert getattr(group, name) == EngineConfig.default(name)
    assert EngineConfig.field_group("nonsense") is None


def test_an_unknown_setting_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="unexpected setting 'kv_cache_memory_bytes'"):
        EngineConfig.from_kwargs("/m", kv_cache_memory_bytes=1)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"block_size": 0}, "block_size must be an integer >= 1"),
        ({"num_blocks": 1}, "num_blocks must be an integer >= 2"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
        ({"max_model_len": 0}, "max_model_len must be a positive integer"),
        ({"enable_chunked_prefill": False, "max_model_len": 4096}, "max_num_batched_tokens must be >= max_model_len"),
        ({"long_prefill_token_threshold": 8, "enable_chunked_prefill": False}, "needs chunked prefill, which enable_chunked_prefill=False turns off"),
        ({"device": "tpu"}, "device must be None or one of"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"seed": 1.5}, "seed must be an integer or None"),
        ({"attention_backend": "flash"}, "attention_backend must be None or one of"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
    ],
)
def test_each_bad_value_is_refused_where_it_is_given_naming_the_setting(settings, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs("/m", **settings)


def test_the_resolved_configs_take_what_only_a_running_engine_knows() -> None:
    config = EngineConfig.from_kwargs("/m", block_size=8, max_num_batched_tokens=512, enable_prefix_caching=False)
    scheduler = config.scheduler_config(max_model_len=1024)
    assert (scheduler.max_model_len, scheduler.max_num_batched_tokens) == (1024, 512)
    cache = config.cache_config(num_blocks=100, model_id="llama@abc")
    assert (cache.block_size, cache.num_blocks, cache.enable_prefix_caching, cache.model_id) == (8, 100, False, "llama@abc")


def test_the_groups_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig("/m").cache.block_size = 8  # type: ignore[misc]
