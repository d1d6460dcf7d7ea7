"""What ``kvserve serve`` warns of once its replicas' pools are sized: a ``--tenant-cache-share`` whose
protected blocks per tenant cannot hold one prompt of ``max_model_len`` tokens."""

from __future__ import annotations

import logging

import pytest

from kvserve.cluster.cli_serve_engine import warn_of_a_small_tenant_cache_share
from kvserve.scheduler.engine_config import EngineConfig
from kvserve.scheduler.tenant_block_pool import TenantBlockPool

LOGGER = "kvserve.cluster.cli_serve_engine"


def engine(**settings: object) -> EngineConfig:
    return EngineConfig.from_kwargs("/models/m", block_size=16, **settings)


def warnings_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_a_share_smaller_than_one_longest_prompt_is_warned_of_with_both_sizes(caplog: pytest.LogCaptureFixture) -> None:
    # 0.01 of 4,095 usable blocks is 40 blocks (640 tokens); a 2,048-token prompt fills 128.
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        warn_of_a_small_tenant_cache_share(engine(tenant_cache_share=0.01), 2048, [4096, 4096])

    [warning] = warnings_logged(caplog)  # once for the two replicas of one pool size
    assert warning == (
        "--tenant-cache-share 0.01 protects 40 of a replica's 4095 usable KV blocks (640 tokens) per tenant "
        "(2 replica(s) of that size), fewer than the 128 blocks one prompt of max_model_len (2048 tokens) "
        "fills: a tenant's protected prefix cache cannot hold one full-length prompt; --tenant-cache-share 0.04 "
        "or more would"
    )


def test_the_warning_counts_blocks_as_the_tenant_pool_does() -> None:
    # The protected blocks the warning names are the pool's own bound.
    assert TenantBlockPool(4096, 0.01).max_cached_blocks_per_tenant == 40


def test_a_share_that_holds_one_longest_prompt_is_not_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        # The share the warning above advises: 163 blocks >= 128.
        warn_of_a_small_tenant_cache_share(engine(tenant_cache_share=0.04), 2048, [4096])
        # Exactly one prompt's blocks: 1.0 of 128 usable blocks (129 with the null block) holds its 128.
        warn_of_a_small_tenant_cache_share(engine(tenant_cache_share=1.0), 2048, [129])

    assert warnings_logged(caplog) == []


def test_a_prompt_that_ends_inside_a_block_needs_that_block_too(caplog: pytest.LogCaptureFixture) -> None:
    # 2,049 tokens fill 129 blocks of 16 (rounded up); 1.0 of 128 usable blocks holds only 128.
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        warn_of_a_small_tenant_cache_share(engine(tenant_cache_share=1.0), 2049, [129])

    [warning] = warnings_logged(caplog)
    assert "protects 128 of a replica's 128 usable KV blocks (2048 tokens)" in warning
    assert "fewer than the 129 blocks one prompt of max_model_len (2049 tokens) fills" in warning
    assert "or more would" not in warning  # no share can do it in so small a pool


def test_each_pool_size_is_judged_on_its_own(caplog: pytest.LogCaptureFixture) -> None:
    # 0.01 of 19,999 usable blocks is 199, enough for 128; of 4,095, 40 is not.
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        warn_of_a_small_tenant_cache_share(engine(tenant_cache_share=0.01), 2048, [4096, 20000, 4096, 20000])

    [warning] = warnings_logged(caplog)
    assert "protects 40 of a replica's 4095 usable KV blocks (640 tokens) per tenant (2 replica(s) of that size)" \
        in warning


@pytest.mark.parametrize("settings", [{}, {"tenant_cache_share": 0.01, "enable_prefix_caching": False}])
def test_nothing_is_warned_of_where_no_tenant_pool_runs(
    caplog: pytest.LogCaptureFixture, settings: dict[str, object]
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        warn_of_a_small_tenant_cache_share(engine(**settings), 2048, [4096])

    assert warnings_logged(caplog) == []
