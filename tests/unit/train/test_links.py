"""[Note: measured links] in tidal/train/links.py: the saver planner's links, measured."""

from __future__ import annotations

import torch

from tidal.train.links import measure_links


def test_one_process_measures_its_host_link_and_has_no_peer() -> None:
    links = measure_links(torch.device("cpu"), num_bytes=1 << 20)
    assert links.host_bytes_per_s > 0 and links.peer_bytes_per_s == 0.0
