"""A model built on the meta device never sits whole in a rank's memory ([Note: deferred
construction] in tidal/memory/materialize.py), measured by the process's peak resident set.

Each build runs in a fresh process that resets its peak RSS (``/proc/self/clear_refs``) after
a tiny warm-up build, then builds a 51M-parameter GPT (202 MB in fp32) into the chunk engine with a host
budget that sends nearly every shard to the NVMe tier, and reports how far its peak grew. SGD
without momentum keeps no optimizer state, so the disk holds little more than the weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_BUILD = textwrap.dedent(
    """
    import json, sys
    from dataclasses import replace
    import tidal
    from tidal.models import build_gpt, gpt_init, num_params, preset

    def peak_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    mode, nvme_dir = sys.argv[1], sys.argv[2]
    config = replace(preset("tiny"), d_model=512, num_layers=16, num_heads=8)
    job = {"engine": "chunk", "chunk": {"size": 1 << 20}, "training": {"device": "cpu"},
           "optimizer": {"name": "sgd", "momentum": 0.0},
           "memory": {"host_budget": "60MiB", "nvme_dir": nvme_dir}}
    # The first build of a process loads code and fills caches whatever the model's size: a tiny
    # one first, so that the peak measured below is what the model itself costs.
    tiny = build_gpt(preset("tiny"), device="meta")
    tidal.initialize(tiny, {**job, "memory": {}}, init=gpt_init(tiny, seed=0))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak restarts from what is resident now
    before = peak_kib()
    if mode == "deferred":
        model = build_gpt(config, device="meta")
        engine = tidal.initialize(model, job, init=gpt_init(model, seed=0))
    else:
        model = build_gpt(config, seed=0)
        engine = tidal.initialize(model, job)
    stats = engine.stats()
    print(json.dumps({"growth_bytes": (peak_kib() - before) * 1024,
                      "model_bytes": 4 * num_params(model),
                      "param_shards_on_nvme": stats["param_shards_on_nvme"],
                      "num_chunks": stats["num_chunks"]}))
    """
)


def _build(mode: str, nvme_dir: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", _BUILD, mode, str(nvme_dir)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux procfs")
def test_a_deferred_model_never_sits_whole_in_memory(tmp_path: Path) -> None:
    whole = _build("whole", tmp_path)
    deferred = _build("deferred", tmp_path)
    model_bytes = deferred["model_bytes"]
    assert deferred["param_shards_on_nvme"] >= deferred["num_chunks"] - 2
    # Built whole, the model and then its chunks are resident: the measure sees it.
    assert whole["growth_bytes"] > model_bytes
    # Deferred: one parameter's value, a shard or two, and what the heap keeps of them; about
    # 30 MB here whatever the model's size (25 MB for half of it).
    assert deferred["growth_bytes"] < model_bytes / 4
