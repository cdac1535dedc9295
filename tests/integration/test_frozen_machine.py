"""A machine that freezes (SIGSTOP of its launcher, which hosts the rendezvous store, and of its
rank) while two "machines" on loopback train one job: the other machine's rank names the silent
store and exits 75 ([Note: a deadline apart from the store] in tidal/distributed/watchdog.py),
and its launcher, whose torchrun agent then blocks on that store, exits 75 as well instead of
hanging ([Note: an agent stuck after its ranks] in tidal/distributed/launch.py)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 60.0  # the watchdog's 3 s, the agent's 2 s grace, a 5 s probe, start-up; was a hang


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rpartition(")")[2].split()[1]) == pid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the ranks")
def test_the_machine_left_when_the_store_host_freezes_exits_75(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TIDAL_HEARTBEAT_S": "0.2",
           "TIDAL_DEAD_AFTER_S": "3", "TIDAL_AGENT_GRACE_S": "2"}  # fmt: skip
    argv = [sys.executable, "-m", "tidal", "train", "--recipe", "tiny", "--no-plots",
            "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--set", f"run_dir={tmp_path / 'run'}", "--set", "training.steps=100000",
            "--set", "training.log_every=1", "--set", "data.source=synthetic",
            "--set", "data.synthetic_num_tokens=20000", "--set", "checkpoint.at_end=false"]  # fmt: skip
    logs = [tmp_path / f"machine{i}.log" for i in range(2)]
    machines = []
    for log in logs:  # the first to start hosts the rendezvous store
        with log.open("w") as out:
            machines.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                             cwd=tmp_path, start_new_session=True))  # fmt: skip
        time.sleep(2)
    frozen: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not re.search(r"step +2/", logs[0].read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert re.search(r"step +2/", logs[0].read_text()), logs[0].read_text()
        frozen = [machines[0].pid, *_children(machines[0].pid)]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        code = machines[1].wait(timeout=3 * BOUND_S)
        elapsed = time.monotonic() - start
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        machines[1].kill()
    said = logs[1].read_text()
    assert code == 75 and elapsed < BOUND_S, (code, elapsed, said)
    assert "tidal: the job's store stopped answering" in said, said
    assert "torchrun's agent cannot finish: the rendezvous store at 127.0.0.1" in said, said
