"""The KubeRay head container's script, run here with stand-ins for Ray and ``kvserve``: it is
the pod's PID 1, which ignores the signals it has no handler for, so deleting the pod must reach
the front end through the script's own handler (before, the pod waited out its grace period and
was killed, streams and all)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.deploy.stand_ins import recorded_lines
from tests.deploy.test_configs import KUBERAY_FILES, head_container, raycluster

# `ray status` answers at once; `ray stop` is recorded.  The stand-in for `ray start --block` sleeps.
FAKE_RAY = """#!/usr/bin/env bash
[ "$1" = stop ] && echo "ray stop" >> "$RECORD"
exit 0
"""
# Fails its first run (no worker pod yet), then serves until SIGTERM, recording both.
FAKE_KVSERVE = """#!/usr/bin/env bash
echo "serve" >> "$RECORD"
[ "$(grep -c serve "$RECORD")" -gt 1 ] || exit 1
trap 'echo "serve stopped" >> "$RECORD"; exit 0' TERM
while true; do sleep 0.05; done
"""


@pytest.mark.parametrize("name", KUBERAY_FILES)
def test_sigterm_stops_the_front_end_then_ray_and_the_container_exits_0(name: str, tmp_path: Path) -> None:
    (script,) = head_container(raycluster(name))["args"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for program, text in (("ray", FAKE_RAY), ("kvserve", FAKE_KVSERVE)):
        (bin_dir / program).write_text(text)
        (bin_dir / program).chmod(0o755)
    # The script's 30 s retry pause, cut to 0.1 s by a stand-in sleep.
    (bin_dir / "sleep").write_text('#!/usr/bin/env bash\n[ "$1" = 30 ] && exec /bin/sleep 0.1\nexec /bin/sleep "$@"\n')
    (bin_dir / "sleep").chmod(0o755)
    recorded = tmp_path / "record"
    env = os.environ | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(recorded),
        "KUBERAY_GEN_RAY_START_CMD": "exec /bin/sleep 300",
    }
    log = tmp_path / "log"
    with log.open("w") as output:  # not a pipe: the stand-in Ray, which `ray stop` does not stop, holds it
        head = subprocess.Popen(["/bin/bash", "-c", "--", script], env=env, start_new_session=True,
                                stdout=output, stderr=output)
    try:
        assert recorded_lines(recorded, 2) == ["serve", "serve"]  # run again after its failure
        time.sleep(0.2)  # the second run's handler is set
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait()
    stderr = log.read_text()
    assert head.returncode == 0, stderr
    assert recorded_lines(recorded, 4)[2:] == ["serve stopped", "ray stop"]
    assert "kvserve serve failed (exit status 1); retrying in 30 s" in stderr
