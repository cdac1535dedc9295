"""The optimizer with part of its update on the host (and on NVMe) equals torch's own."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tidal.config import ConfigError
from tidal.memory.share import ON_HOST, host_share
from tidal.parallel.config import OptimizerConfig
from tidal.parallel.reference import build_optimizer
from tidal.runtime.host_optimizer import HostOptimizerConfig, HostStepped


def test_host_share_falls_short_by_less_than_the_smallest_share_left_out() -> None:
    assert host_share([4, 4, 4, 4], 0.5) == {0, 1}
    assert host_share([4, 4, 4, 4], 0.0) == set()
    assert host_share([4, 4, 4, 4], 1.0) == {0, 1, 2, 3}
    assert host_share([10, 1, 1], 0.5) == {1, 2}  # the large one would overshoot
    assert host_share([1, 1, 10], 0.9) == {2}
    assert host_share([], 0.7) == set()
    # an empty piece (a stage's root without parameters) moves only with everything
    assert host_share([0, 4, 4], 0.0) == set() and host_share([0, 4, 4], 0.5) == {1}
    assert host_share([0, 4, 4], 1.0) == {0, 1, 2}
    sizes = [3, 700, 5, 120, 64, 64, 9, 300]
    for fraction in (0.1, 0.25, 0.5, 0.8):
        taken = host_share(sizes, fraction)
        short = fraction * sum(sizes) - sum(sizes[i] for i in taken)
        assert 0 <= short < min(s for i, s in enumerate(sizes) if i not in taken)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4), nn.Linear(4, 4))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range,
           *, skip: str = "") -> None:  # fmt: skip
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        for name, p in model.named_parameters():
            p.grad = None if name.startswith(skip) and skip else torch.randn(
                p.shape, generator=gen)  # fmt: skip
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 / (1 + step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("fraction,nvme", [(0.5, 0.0), (1.0, 0.5), (0.3, 1.0)])
def test_host_update_equals_the_device_update_and_resumes(tmp_path, fraction, nvme) -> None:
    config = OptimizerConfig(weight_decay=0.1)
    reference = _model()
    ref_opt = build_optimizer(reference, config, 1e-2)
    model = copy.deepcopy(reference)
    offload = HostOptimizerConfig(fraction=fraction, nvme_fraction=nvme,
                                  nvme_dir=str(tmp_path) if nvme else None)  # fmt: skip
    stepped = HostStepped(build_optimizer(model, config, 1e-2), offload)
    assert 0 < len(stepped.on_host) <= len(list(model.parameters()))
    _train(reference, ref_opt, range(3), skip="3")  # the last layer gets no gradient at first
    _train(model, stepped, range(3), skip="3")
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    held = stepped.host_bytes()
    # in host memory between steps: AdamW's moments, unless all are on NVMe (then the step
    # counts alone, 4 bytes each)
    moments = held["state"] > 4 * len(stepped.on_host)
    assert (held["nvme"] > 0) == bool(nvme) and moments == (nvme < 1)

    # torch's own format: the reference's optimizer loads it, and a run offloading another
    # share resumes from it as the reference does
    saved = stepped.state_dict()
    assert saved["state"].keys() == ref_opt.state_dict()["state"].keys()
    for i, state in ref_opt.state_dict()["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(saved["state"][i][key], value, rtol=0, atol=1e-7)
    resumed = copy.deepcopy(model)
    other = HostStepped(build_optimizer(resumed, config, 1.0),
                        HostOptimizerConfig(fraction=1 - fraction))  # fmt: skip
    other.load_state_dict(copy.deepcopy(saved))  # as from a file: torch's hands references
    _train(reference, ref_opt, range(3, 6))
    _train(resumed, other, range(3, 6))
    _train(model, stepped, range(3, 6))
    for a, b, c in zip(reference.parameters(), resumed.parameters(), model.parameters(),
                       strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=0, atol=1e-6)
    stepped.close()
    assert not list(tmp_path.iterdir()) or not any(p.iterdir() for p in tmp_path.iterdir())


def test_parameters_already_on_the_host_are_their_own_masters() -> None:
    """FSDP2's offloaded groups (marked ON_HOST) are updated in place on the host, and the
    share is made up beside them: ``f`` of the bytes in all."""
    config = OptimizerConfig(weight_decay=0.1)
    reference = _model()
    ref_opt = build_optimizer(reference, config, 1e-2)
    model = copy.deepcopy(reference)
    first = model[0].weight  # 128 of the 264 elements
    setattr(first, ON_HOST, True)
    stepped = HostStepped(build_optimizer(model, config, 1e-2), HostOptimizerConfig(fraction=0.6))
    assert stepped.on_host[0] is first and stepped.host.param_groups[0]["params"][0] is first
    share = sum(p.numel() for p in stepped.on_host) / sum(p.numel() for p in model.parameters())
    assert 0.5 < share <= 0.6
    _train(reference, ref_opt, range(4))
    _train(model, stepped, range(4))
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_nvme_without_a_folder_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match="memory.nvme_dir"):
        HostOptimizerConfig(fraction=1.0, nvme_fraction=0.5)
