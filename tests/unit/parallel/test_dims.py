"""[Note: one mesh]: the pp x dp x tp grid, its groups, its checks, --mesh and the renamed key."""

from __future__ import annotations

import pytest

from tidal.config import ConfigError
from tidal.parallel.dims import ParallelConfig, ParallelDims, parse_mesh
from tidal.train.job import load_job


def test_ranks_sit_in_the_grid_tensor_innermost() -> None:
    dims = ParallelDims(pp=2, dp=3, tp=2)
    assert dims.world_size == 12
    assert [dims.coords(r) for r in (0, 1, 2, 5, 6, 11)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 2, 1), (1, 0, 0), (1, 2, 1),
    ]  # fmt: skip
    assert all(dims.rank_at(*dims.coords(r)) == r for r in range(12))
    assert dims.group_ranks("tp")[:2] == [[0, 1], [2, 3]]
    assert dims.group_ranks("dp")[:2] == [[0, 2, 4], [1, 3, 5]]
    assert dims.group_ranks("pp")[0] == [0, 6]
    for dim, size in (("pp", 2), ("dp", 3), ("tp", 2)):
        groups = dims.group_ranks(dim)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(12))  # each rank once
    assert str(dims) == "pp2 x dp3 x tp2"


def test_dp_takes_the_ranks_left_and_a_wrong_count_is_one_line() -> None:
    assert ParallelConfig(pp=2).resolve(8) == ParallelDims(pp=2, dp=4, tp=1)
    assert ParallelConfig().resolve(3) == ParallelDims(dp=3)
    with pytest.raises(ConfigError, match=r"pp2 x dp3 x tp1 needs 6 ranks, but 4 were started"):
        ParallelConfig(pp=2, dp=3).resolve(4)
    with pytest.raises(ConfigError, match=r"pp3 x dp1 x tp1 needs 3 ranks, but 4"):
        ParallelConfig(pp=3).resolve(4)  # 4 // 3 replicas would leave a rank idle
    with pytest.raises(ConfigError, match="pp: must be >= 1"):
        ParallelConfig(pp=0)


def test_mesh_flag_parses_and_names_a_wrong_part() -> None:
    assert parse_mesh("pp=2,dp=2") == {"pp": 2, "dp": 2}
    assert parse_mesh(" tp=4 ") == {"tp": 4}
    for bad, says in (("pp=2,xx=3", "'xx=3' is not NAME=N"), ("pp2", "'pp2' is not"),
                      ("pp=2,pp=3", "pp is given twice"), ("", "is empty"),
                      ("dp=0", "must be >= 1")):  # fmt: skip
        with pytest.raises(ConfigError, match=says):
            parse_mesh(bad)


def test_pipeline_stages_of_older_recipes_is_parallel_pp() -> None:
    job = load_job("tiny", ["pipeline.stages=2", "pipeline.microbatches=2"])
    assert job.parallel.pp == 2 and job.pipelined and job.num_microbatches == 2
    assert load_job("tiny", {"pipeline": {"stages": 3}}).num_microbatches == 3  # one per stage
    assert load_job("tiny", ["parallel.pp=2", "pipeline.stages=2"]).parallel.pp == 2
    with pytest.raises(ConfigError, match=r"pipeline.stages: is parallel.pp now; .* \(2 and 4\)"):
        load_job("tiny", ["parallel.pp=4", "pipeline.stages=2"])
    # [Note: one train step]: tensor parallelism or FSDP2 without a pipeline is one stage
    assert load_job("tiny", ["parallel.tp=2"]).needs_stages
    assert load_job("tiny", ["parallel.fsdp2=true"]).needs_stages
    assert not load_job("tiny", ["parallel.dp=2"]).needs_stages  # plain replicas
    assert load_job("tiny", ["parallel.pp=2", "parallel.tp=2"]).parallel.tp == 2
