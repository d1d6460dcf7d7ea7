"""scripts/gpu_check.sh keeps to its time budget (GPU_CHECK_BUDGET_S): a slow step shortens the later ones, so that the
device tool's limit (600 s a command) never cuts the run and the output of the steps that ran."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_slow_step_leaves_the_later_ones_only_what_is_left_of_the_budget(tmp_path: Path) -> None:
    # A stand-in Python: imports succeed at once; each benchmark sleeps far past any budget, and
    # says which it is.
    log = tmp_path / "log.txt"
    fake_python = tmp_path / "python"
    fake_python.write_text(
        "#!/usr/bin/env bash\n"
        '[[ "$1" == "-c" ]] && exit 0\n'
        f'echo "$2 $4" >>{log}\n'
        "exec sleep 60\n"
    )
    fake_smi = tmp_path / "bin" / "nvidia-smi"
    fake_smi.parent.mkdir()
    fake_smi.write_text("#!/usr/bin/env bash\necho 'name\nstand-in GPU'\n")
    for path in (fake_python, fake_smi):
        path.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake_python), "OUT": str(tmp_path / "out"), "GPU_CHECK_BUDGET_S": "13",
           "PATH": f"{fake_smi.parent}:{os.environ['PATH']}"}
    start = time.monotonic()
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "layerops serving1b serving8b"],
                            capture_output=True, text=True, env=env, timeout=60)
    took = time.monotonic() - start
    # Budget 13 s, less 10 s to print: layerops gets 3 s, then 1 s is all each later step gets.
    assert 3 <= took < 9, result.stdout + result.stderr
    started = [line.split() for line in log.read_text().splitlines()]
    assert [fields[0] for fields in started] == ["kvserve.bench.layer_ops", "kvserve.bench.gpu_serving",
                                                 "kvserve.bench.gpu_serving"]
    assert [fields[1] for fields in started[1:]] == ["llama-3.2-1b", "llama-3-8b"]  # the 1B shape first
    assert result.returncode == 1  # timed-out steps fail the run
    assert "gpu_check took" in result.stdout and "budget 13 s" in result.stdout
