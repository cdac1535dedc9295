"""Forward-only evaluation through a pipeline's stages, over the runtime's point-to-point wire."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tidal.pipeline.ir import Action, Kind, Schedule, with_communication
from tidal.runtime.executor import LocalTransport, MessageKey

__all__ = ["evaluate_stages", "forward_schedule"]


def forward_schedule(num_ranks: int, num_stages: int, num_batches: int) -> Schedule:
    """Each rank runs its stages' forwards batch by batch, in stage order: no backward, no update.

    Every rank finishes batch ``i`` on all its stages before batch ``i + 1``, and a stage needs
    only the stage before it, so the programs cannot deadlock (sends never block).
    """
    programs = []
    for rank in range(num_ranks):
        stages = range(rank, num_stages, num_ranks)
        programs.append(
            tuple(
                Action(stage=s, kind=Kind.FORWARD, microbatch=i)
                for i in range(num_batches)
                for s in stages
            )
        )
    return Schedule(
        name="forward",
        num_ranks=num_ranks,
        num_stages=num_stages,
        num_microbatches=num_batches,
        programs=tuple(programs),
    )


@torch.no_grad()
def evaluate_stages(
    modules: Mapping[int, nn.Module],
    *,
    num_ranks: int,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
) -> float:
    """Mean loss of ``batches`` through the pipeline; every rank of the group gets it.

    ``modules`` maps this rank's stage indices to stage modules (first stage takes token ids,
    the last returns the loss given targets). With one rank no process group is needed.
    """
    from tidal.runtime.distributed import P2PTransport

    num_stages = num_ranks * len(modules)
    rank = dist.get_rank(group) if num_ranks > 1 else 0
    schedule = with_communication(forward_schedule(num_ranks, num_stages, len(batches)))
    transport = (
        P2PTransport(schedule, rank, group=group, device=device)
        if num_ranks > 1
        else LocalTransport()
    )
    was_training = {s: m.training for s, m in modules.items()}
    for m in modules.values():
        m.eval()
    local: dict[tuple[int, int], torch.Tensor] = {}  # (stage, batch) -> output, same-rank hand-off
    total = torch.zeros((), dtype=torch.float64, device=device)
    last = num_stages - 1
    for a in schedule.programs[rank]:
        s, i = a.stage, a.microbatch
        if a.kind is Kind.RECV_FORWARD:
            local[(s - 1, i)] = transport.recv(MessageKey(s - 1, s, i))
        elif a.kind is Kind.SEND_FORWARD:
            transport.send(MessageKey(s, s + 1, i), local.pop((s, i)))
        elif a.kind is Kind.FORWARD:
            x = batches[i][0] if s == 0 else local.pop((s - 1, i))
            if s == last:
                total += modules[s](x, batches[i][1]).double()
            else:
                local[(s, i)] = modules[s](x)
    transport.flush()
    for s, m in modules.items():
        m.train(was_training[s])
    if num_ranks > 1:
        src = schedule.rank_of(last)
        src = src if group is None else dist.get_global_rank(group, src)
        total = total.cpu() if dist.get_backend(group) != "nccl" else total
        dist.broadcast(total, src=src, group=group)
    return float(total) / len(batches)
