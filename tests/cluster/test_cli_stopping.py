"""``kvserve serve`` stopped by Ctrl-C, SIGTERM or a dead scheduler, at every stage: nothing is left running."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvserve.worker.tiny_model import create_tiny_model
from tests.cluster.serve_subprocess import (
    COMMAND_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    ServeProcess,
    assert_nothing_left,
    kill_what_is_left,
    serve_env,
    session_processes,
    simulated_serve,
    wait_for_session_process,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("cli-stop-model"), "llama", seed=0)


# NOTE: "raylet" is the moment that mattered: a Ctrl-C inside ray.init then left
# Ray's agents running after `serve` had exited.  SIGTERM (systemd, Kubernetes,
# kill) goes to the serve process alone; after ray.init it met Ray's own handler,
# which printed a stack and aborted.
@pytest.mark.parametrize(
    "when, sig",
    [("raylet", signal.SIGINT), ("serving model", signal.SIGINT), ("raylet", signal.SIGTERM),
     ("serving model", signal.SIGTERM),
     # while the replicas' actors start, and between the last replica's start and the listening port
     ("starting 1 replica", signal.SIGTERM), ("replica 0 ready", signal.SIGINT)],
)
def test_ctrl_c_or_sigterm_during_start_up_stops_everything_it_started(tmp_path, model_dir, when, sig):
    process = simulated_serve(tmp_path, model_dir)
    session_id = process.proc.pid
    try:
        if when == "raylet":
            wait_for_session_process(process, "raylet", STARTUP_TIMEOUT_S)
        else:
            process.wait_for(when, STARTUP_TIMEOUT_S)
        if sig == signal.SIGINT:
            # As Ctrl-C in a terminal: SIGINT to the whole process group, Ray's daemons included.
            os.killpg(session_id, signal.SIGINT)
        else:
            os.kill(session_id, sig)
        returncode = process.proc.wait(timeout=COMMAND_TIMEOUT_S)
        output = process.output()
        assert returncode == 0, output
        assert "stopped" in output
        assert "Traceback" not in output and "SIGTERM received" not in output
        assert_nothing_left(session_id)
    finally:
        kill_what_is_left(session_id)


def test_sigterm_to_the_whole_process_group_stops_without_waiting_for_rays_gcs(tmp_path, model_dir):
    # As `timeout`, `kill -- -PGID` or a service manager send it: Ray's daemons
    # stop at once too.  serve waited 20 s on the scheduler, then its core
    # worker 40 s more for the GCS, and ended with exit status 1 ("Failed to
    # connect to GCS within 60 seconds ... The program will terminate").
    process = simulated_serve(tmp_path, model_dir)
    session_id = process.proc.pid
    try:
        process.wait_for("listening on", STARTUP_TIMEOUT_S)
        start = time.monotonic()
        os.killpg(session_id, signal.SIGTERM)
        returncode = process.wait_exit(COMMAND_TIMEOUT_S)
        elapsed = time.monotonic() - start
        output = process.output()
        assert returncode == 0, output
        # It exits as soon as Ray's log monitor has (some 0.1 s in): it waited ~10 s for the raylet's
        # own shutdown, which lasts while this driver is connected (under 1 s now on an idle machine).
        assert elapsed < 8.0, output
        assert "Ray's own processes have stopped" in output and "stopped" in output
        assert "Traceback" not in output and "Failed to connect to GCS" not in output
        assert_nothing_left(session_id)
    finally:
        kill_what_is_left(session_id)


def test_sigterm_during_a_live_experiments_replay_stops_it_as_ctrl_c_does(tmp_path, model_dir):
    # SIGTERM raised KeyboardInterrupt wherever the main thread was, inside gRPC's and
    # Ray's machinery under the replay's event loop: the process died of SIGSEGV (5 of 6
    # tries) and left Ray's processes running.
    process = ServeProcess(
        ["--workload", "shared_prefix", "--replicas", "1", "--qps", "8", "--live", "--time-scale", "1",
         "--num-requests", "60", "--policies", "round_robin", "--model", str(model_dir), "--no-plots",
         "--out", str(tmp_path / "run")],
        serve_env(tmp_path), new_session=True, command="experiment",
    )
    session_id = process.proc.pid
    try:
        process.wait_for(r"round_robin @ 8 qps: +\d+% \(", STARTUP_TIMEOUT_S)  # replaying
        os.kill(session_id, signal.SIGTERM)
        returncode = process.proc.wait(timeout=COMMAND_TIMEOUT_S)
        output = process.output()
        assert returncode == 130, output
        assert output.rstrip().endswith("kvserve experiment: interrupted"), output
        assert "SIGSEGV" not in output and "Traceback" not in output
        assert not (tmp_path / "run" / "summary.md").exists()
        assert_nothing_left(session_id)
    finally:
        kill_what_is_left(session_id)


def test_a_second_sigterm_while_shutting_down_leaves_nothing_behind(tmp_path, model_dir):
    process = simulated_serve(tmp_path, model_dir)
    session_id = process.proc.pid
    try:
        process.wait_for("listening on", STARTUP_TIMEOUT_S)
        os.kill(session_id, signal.SIGTERM)
        process.wait_for("shutting down the replicas", COMMAND_TIMEOUT_S)
        os.kill(session_id, signal.SIGTERM)
        # It either cut the shutdown short or had finished it: nothing may be left either way.
        returncode = process.proc.wait(timeout=COMMAND_TIMEOUT_S)
        output = process.output()
        assert returncode in (0, 130), output
        assert "SIGTERM received" not in output
        assert_nothing_left(session_id)
    finally:
        kill_what_is_left(session_id)


def test_serve_exits_non_zero_at_once_when_the_scheduler_actor_dies(tmp_path, model_dir):
    # A supervisor (systemd, Kubernetes) then starts it again; health said SERVING while nothing could serve.
    process = simulated_serve(tmp_path, model_dir)
    session_id = process.proc.pid
    try:
        process.wait_for("listening on", STARTUP_TIMEOUT_S)
        scheduler = next(line for line in session_processes(session_id) if "SchedulerActor" in line)
        start = time.monotonic()
        os.kill(int(scheduler.split()[1]), signal.SIGKILL)
        returncode = process.proc.wait(timeout=COMMAND_TIMEOUT_S)
        output = process.output()
        assert returncode == 1, output
        assert time.monotonic() - start < 30.0, output
        assert "the scheduler actor died" in output and "Traceback" not in output
        assert_nothing_left(session_id)
    finally:
        kill_what_is_left(session_id)
