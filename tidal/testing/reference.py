"""The parity baseline: a job trained by the reference engine in a plain loop, one process.

Every run of the Trainer is on stages ([Note: one train step] in tidal/train/job.py); what they
are checked against is plain PyTorch, the reference engine (``tidal.initialize``'s for
``engine = "reference"``), driven here as a user drives it: ``loss = engine(x, y);
engine.backward(loss); engine.step()`` for each of a step's ``grad_accum_steps`` batches, drawn
from the job's own sampler in the Trainer's order, with the model built from the job's seed.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal.models import spec_for
from tidal.train.build import build_engine, build_samplers
from tidal.train.job import JobConfig, load_job
from tidal.train.losses import default_loss

__all__ = ["reference_losses"]


def reference_losses(job: JobConfig | str | dict[str, Any]) -> list[float]:
    """Each of ``job``'s training steps' mean loss over its batches, on the reference engine."""
    job = job if isinstance(job, JobConfig) else load_job(job)
    training = job.training
    assert job.engine == "reference" and not job.needs_stages, "the one-process baseline"
    torch.manual_seed(training.seed)
    spec = spec_for(job.model.resolve())
    if spec.deferred:
        model = spec.build(device="meta")
        engine = build_engine(model, job, init=spec.init(model, training.seed))
    else:  # a factory model, built for real
        engine = build_engine(spec.build(device="cpu", seed=training.seed), job)
    batches, _ = build_samplers(job)
    losses = []
    for _ in range(training.steps):
        total = 0.0
        for _ in range(training.grad_accum_steps):
            inputs, targets = (t.to(engine.device) for t in batches.next_batch())
            loss = (engine(inputs, targets) if spec.computes_loss
                    else default_loss(engine(inputs), targets))  # fmt: skip
            engine.backward(loss)
            total += float(loss.detach())
            engine.step()
        losses.append(total / training.grad_accum_steps)
    return losses
