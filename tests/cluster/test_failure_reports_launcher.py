"""What the launcher tells an operator about Ray: the address it started, and a scheduler found dead at shutdown.

Without Ray: its calls are stubbed, so that each report can be staged exactly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
from ray.exceptions import ActorDiedError

from kvserve.cluster import launcher
from kvserve.cluster.serve_runtime import init_ray

# Ray's account of an actor killed with SIGKILL (Ray 2.60), shortened.
ACTOR_DEATH = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: SchedulerActor\n"
    "\tactor_id: eb4ef4f23adcd47846200f7601000000\n\tpid: 11991\n\tnamespace: kvserve\n\tip: 127.0.0.1\n"
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR"
)
CPU_CONFIG = SimpleNamespace(
    simulation=None, engine=SimpleNamespace(runtime=SimpleNamespace(device="cpu")), parallel=SimpleNamespace(num_workers=1)
)


class _DeadActorMethod:
    def remote(self) -> str:
        return "a reference"


class _DeadScheduler:
    placement_groups = _DeadActorMethod()
    shutdown = _DeadActorMethod()


def _raise_actor_died(*args: object, **kwargs: object) -> None:
    raise ActorDiedError()


def test_a_scheduler_found_dead_at_shutdown_is_one_warning_line_and_rays_account_at_debug(
    monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    monkeypatch.setattr(ActorDiedError, "__str__", lambda self: ACTOR_DEATH)
    monkeypatch.setattr(ray, "get", _raise_actor_died)
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: (refs, []))
    killed = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: killed.append(actor))

    with caplog.at_level("DEBUG", logger="kvserve.cluster.launcher"):
        launcher._stop(_DeadScheduler(), (), timeout_s=1.0)

    warnings = [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert warnings == ["the scheduler did not shut down: its actor was dead already (ActorDiedError)"]
    assert {r.levelname for r in caplog.records if ACTOR_DEATH in r.getMessage()} == {"DEBUG"}
    assert len(killed) == 1


def test_serve_prints_the_gcs_address_of_the_ray_instance_it_started_and_how_to_reach_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def init_local_ray(slots: int, report: object) -> str:
        # What keep_ray_on_loopback and ray.init (with token authentication) set.
        monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        return "127.0.0.1:34957"

    monkeypatch.setattr(launcher, "init_local_ray", init_local_ray)
    lines: list[str] = []

    init_ray(None, CPU_CONFIG, lines.append)

    assert lines[-1] == (
        "started a local Ray instance at 127.0.0.1:34957 (its status: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 "
        "RAY_AUTH_MODE=token ray status --address 127.0.0.1:34957)"
    )


def test_serve_prints_the_gcs_address_of_the_cluster_that_auto_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "join_ray", lambda address: "10.0.0.5:6379")
    lines: list[str] = []

    init_ray("auto", CPU_CONFIG, lines.append)

    assert lines == ["joined the Ray cluster at auto (10.0.0.5:6379)"]


@pytest.mark.parametrize(
    ("env", "hint"),
    [
        ({}, "set RAY_AUTH_MODE=token (and RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH"),
        ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/etc/ray/token"},
         "check that this process has the cluster's token (RAY_AUTH_TOKEN_PATH=/etc/ray/token)"),
        ({"RAY_AUTH_MODE": "token"}, "(read from ~/.ray/auth_token: neither RAY_AUTH_TOKEN nor RAY_AUTH_TOKEN_PATH"),
        ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "s3cret-token-value"}, "(RAY_AUTH_TOKEN is set)"),
    ],
)
def test_joining_a_cluster_that_refuses_says_where_the_token_came_from(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], hint: str
) -> None:
    # NOTE: Ray's own refusal of a wrong token takes ~20 s of retries; its final error is what is raised here.
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launcher, "check_gcs_reachable", lambda address: None)

    def refused(**kwargs):
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379")

    monkeypatch.setattr(launcher.ray, "init", refused)
    with pytest.raises(ConnectionError) as info:
        launcher.join_ray("10.0.0.5:6379")
    assert str(info.value).startswith("Failed to connect to Ray cluster at 10.0.0.5:6379; ")
    assert hint in str(info.value)
    assert "s3cret" not in str(info.value)


def test_auto_without_a_cluster_on_this_machine_says_so_without_a_token_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    # It added "if that cluster uses token authentication, set RAY_AUTH_MODE=token": there was no cluster.
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)

    def none_found(**kwargs):
        # Ray 2's words when 'auto' finds no cluster.
        raise ConnectionError(
            "Could not find any running Ray instance. Please specify the one to connect to by setting `--address` "
            "flag or `RAY_ADDRESS` environment variable."
        )

    monkeypatch.setattr(launcher.ray, "init", none_found)
    with pytest.raises(ConnectionError) as info:
        launcher.join_ray("auto")
    assert str(info.value) == (
        "--address auto: no Ray cluster is running on this machine (`ray start --head` starts one; without "
        "--address a local one is started and stopped with the command)"
    )
