"""Building a pipeline stage grows a process's peak resident set by that stage, not by the model
([Note: stages from the meta device] in tidal/pipeline/stage_init.py).

Each build runs in a fresh process that resets its peak (``/proc/self/clear_refs``) after a tiny
warm-up build, then builds one stage of four of a 101M-parameter GPT (405 MB in fp32, about
101 MB a stage) and reports how far its peak grew. The first stage reads the init source up to
its last parameter; the last stage reads all of it, dropping what other stages hold. A whole
build, as pipelines were built before, shows the measure sees a model that sits whole.
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
    import torch
    from tidal.models import GPTConfig, build_stages, num_params, spec_for
    from tidal.pipeline.split import even_ranges

    def peak_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    mode, stage = sys.argv[1], int(sys.argv[2])
    cpu = torch.device("cpu")
    config = GPTConfig(vocab_size=512, seq_len=64, num_layers=8, num_heads=8, d_model=1024,
                       tie_embeddings=False)
    tiny = spec_for(GPTConfig(vocab_size=64, seq_len=8, num_layers=4, num_heads=2, d_model=16))
    # The first build of a process loads code and fills caches whatever the model's size.
    build_stages(tiny, tiny.build(device="meta"), even_ranges(4, 4), mine=[stage], device=cpu,
                 seed=0)
    tiny.split(tiny.build(device=cpu, seed=0), even_ranges(4, 4))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak restarts from what is resident now
    before = peak_kib()
    spec = spec_for(config)
    ranges = even_ranges(config.num_layers, 4)
    if mode == "stage":
        model = spec.build(device="meta")
        held = build_stages(spec, model, ranges, mine=[stage], device=cpu, seed=0)[stage]
    else:  # the whole model, then its stages
        model = spec.build(device=cpu, seed=0)
        held = spec.split(model, ranges)[stage]
    print(json.dumps({"growth_bytes": (peak_kib() - before) * 1024,
                      "model_bytes": 4 * num_params(model),
                      "stage_bytes": sum(4 * p.numel() for p in held.parameters())}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux procfs")
def test_a_stage_costs_its_own_blocks_not_the_model() -> None:
    runs = {(mode, stage): subprocess.Popen([sys.executable, "-c", _BUILD, mode, str(stage)],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            text=True)  # fmt: skip
            for mode, stage in [("stage", 0), ("stage", 3), ("whole", 0)]}  # fmt: skip
    figures = {}
    for key, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        figures[key] = json.loads(out.strip().splitlines()[-1])
    model_bytes = figures["whole", 0]["model_bytes"]
    # Built whole, the model and its stages' copies are resident (814 MB measured): the
    # measure sees a whole build.
    assert figures["whole", 0]["growth_bytes"] > 0.9 * model_bytes
    for stage in (0, 3):
        growth, stage_bytes = (figures["stage", stage][k] for k in ("growth_bytes", "stage_bytes"))
        assert stage_bytes < 0.3 * model_bytes  # about a quarter
        # The stage, one value of the init source at a time (the largest 16 MB) and what the
        # heap keeps of them: measured 136 MB for the first stage, 157 MB for the last.
        assert 0.9 * stage_bytes < growth < 0.5 * model_bytes, figures
