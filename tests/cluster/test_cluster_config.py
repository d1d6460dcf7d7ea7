"""What ``ClusterConfig`` hands each replica's workers."""

from __future__ import annotations

import pytest

from kvserve.cluster.config import ClusterConfig


def test_the_workers_learn_the_resolved_max_model_len() -> None:
    # The scheduler actor resolves it from the model (a sliding window bounds it); the
    # workers check the model against it, and found only max_position_embeddings.
    config = ClusterConfig.from_kwargs("/models/m")
    assert config.worker_config(48).max_model_len == 48
    assert config.worker_config().max_model_len is None


def test_the_engine_settings_are_the_engines_and_the_cluster_adds_its_own() -> None:
    from kvserve.scheduler.engine_config import EngineConfig, ParallelConfig

    config = ClusterConfig.from_kwargs(
        "/models/m", block_size=32, num_blocks=64, parallel=ParallelConfig(num_replicas=3), routing="round_robin",
        placement_timeout_s=None,
    )
    assert config.engine == EngineConfig.from_kwargs("/models/m", block_size=32, num_blocks=64, num_replicas=3)
    assert (config.routing, config.placement_timeout_s, config.parallel.num_replicas) == ("round_robin", None, 3)
    worker = config.worker_config(128)
    assert (worker.model_dir, worker.block_size, worker.num_blocks, worker.max_model_len) == ("/models/m", 32, 64, 128)
    assert config.cache_config(64, "id").block_size == 32


def test_serve_flags_set_the_engine_settings_of_their_names_and_errors_name_the_flags(capsys) -> None:
    from kvserve.cli import build_parser, main
    from kvserve.scheduler.engine_config import EngineConfig

    parser = build_parser()
    args = parser.parse_args(["serve", "--tp", "2", "--replicas", "3", "--block-size", "32"])
    assert (args.tensor_parallel_size, args.num_replicas, args.block_size, args.num_blocks) == (2, 3, 32, None)
    flags = args.flag_terms.flags
    # Every engine setting with a flag is set by its own name: nothing is mapped by hand.
    assert {name for name in EngineConfig.field_names() if name in flags} >= {
        "tensor_parallel_size", "num_replicas", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
        "max_model_len", "device", "enforce_eager",
    }
    assert (flags["tensor_parallel_size"], flags["http_port"]) == ("--tp", "--http-port")
    assert main(["serve", "--block-size", "0"]) == 2
    assert "--block-size must be an integer >= 1, got 0" in capsys.readouterr().err


def test_serve_passes_step_timeout_to_the_cluster_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvserve.cluster.launcher
    from kvserve.cli import build_parser, main

    configs: list[ClusterConfig] = []

    def resolve_model_config(config: ClusterConfig) -> None:
        configs.append(config)
        raise ValueError("stop before starting anything")

    monkeypatch.setattr(kvserve.cluster.launcher, "resolve_model_config", resolve_model_config)
    assert build_parser().parse_args(["serve"]).step_timeout_s == 120.0
    assert main(["serve", "--model", "/models/m", "--step-timeout", "30"]) == 2
    assert main(["serve", "--model", "/models/m"]) == 2
    assert [config.step_timeout_s for config in configs] == [30.0, 120.0]


def test_config_refuses_a_step_timeout_that_is_not_a_positive_number_of_seconds() -> None:
    for bad in (0, -1.0, float("inf"), float("nan"), True, "120"):
        with pytest.raises(ValueError, match="step_timeout_s must be a positive number of seconds"):
            ClusterConfig.from_kwargs("/models/m", step_timeout_s=bad)


def test_serve_passes_max_queue_wait_to_the_cluster_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvserve.cluster.launcher
    from kvserve.cli import main

    configs: list[ClusterConfig] = []

    def resolve_model_config(config: ClusterConfig) -> None:
        configs.append(config)
        raise ValueError("stop before starting anything")

    monkeypatch.setattr(kvserve.cluster.launcher, "resolve_model_config", resolve_model_config)
    for flags in (["--max-queue-wait", "5"], ["--max-queue-wait", "0"], []):
        assert main(["serve", "--model", "/models/m", *flags]) == 2
    assert [config.max_queue_wait_s for config in configs] == [5.0, 0.0, 30.0]


def test_config_refuses_a_max_queue_wait_that_is_not_a_finite_number_of_seconds_from_0() -> None:
    assert ClusterConfig.from_kwargs("/models/m", max_queue_wait_s=0).max_queue_wait_s == 0
    for bad in (-1.0, float("inf"), float("nan"), True, "30"):
        with pytest.raises(ValueError, match="max_queue_wait_s must be a finite number of seconds >= 0"):
            ClusterConfig.from_kwargs("/models/m", max_queue_wait_s=bad)
