"""The DP partitioner against brute force, its memory limits, and layer profiles."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from tidal.config import ConfigError, format_bytes
from tidal.models import profile_decoder, split_model
from tidal.models.gpt import GPTConfig, build_gpt, num_params, preset, profile_gpt
from tidal.pipeline.partition import (
    LayerProfile,
    PartitionInfeasible,
    partition,
    stage_memory_bytes,
)
from tidal.pipeline.split import validate_block_ranges


def _profile(name: str, forward_s: float, param_bytes: int, activation_bytes: int) -> LayerProfile:
    return LayerProfile(
        name=name,
        forward_s=forward_s,
        backward_s=2 * forward_s,
        param_bytes=param_bytes,
        activation_bytes=activation_bytes,
    )


def _memory(profiles: list[LayerProfile], s: int, a: int, b: int, in_flight, versions) -> int:
    return stage_memory_bytes(profiles[a:b], in_flight=in_flight[s], weight_versions=versions[s])


def _brute_force(profiles, num_stages, limits, in_flight, versions):
    """Every contiguous split: (bottleneck, total memory, sum of squared times, ranges) of the
    feasible ones, and the least largest-stage memory over all of them."""
    feasible, least = [], math.inf
    for cuts in itertools.combinations(range(1, len(profiles)), num_stages - 1):
        bounds = (0, *cuts, len(profiles))
        ranges = list(itertools.pairwise(bounds))
        times = [math.fsum(p.forward_s + p.backward_s for p in profiles[a:b]) for a, b in ranges]
        mems = [_memory(profiles, s, a, b, in_flight, versions) for s, (a, b) in enumerate(ranges)]
        least = min(least, max(mems))
        if all(m <= lim for m, lim in zip(mems, limits, strict=True)):
            feasible.append((max(times), sum(mems), sum(t * t for t in times), ranges))
    return feasible, least


def _random_case(rng: random.Random):
    num_units = rng.randint(1, 7)
    num_stages = rng.randint(1, num_units)
    # Integer times: sums are exact, so ties are real ties for both DP and brute force.
    profiles = [
        _profile(f"u{i}", float(rng.randint(0, 6)), rng.randint(0, 50), rng.randint(0, 80))
        for i in range(num_units)
    ]
    in_flight = [rng.randint(1, 4) for _ in range(num_stages)]
    versions = [rng.randint(0, 2) for _ in range(num_stages)]
    limits = [rng.choice([math.inf, rng.randint(100, 900)]) for _ in range(num_stages)]
    return profiles, num_stages, limits, in_flight, versions


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_brute_force_on_random_profiles(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        profiles, p, limits, in_flight, versions = _random_case(rng)
        feasible, least = _brute_force(profiles, p, limits, in_flight, versions)
        kwargs = {
            "memory_limit_bytes": [int(x) if x != math.inf else 10**12 for x in limits],
            "in_flight": in_flight,
            "weight_versions": versions,
        }
        if not feasible:
            with pytest.raises(PartitionInfeasible) as info:
                partition(profiles, p, **kwargs)
            assert info.value.least_bytes == least
            continue
        result = partition(profiles, p, **kwargs)
        best = min(feasible, key=lambda f: f[0])[0]
        assert result.bottleneck_s == best
        ties = [f for f in feasible if f[0] == best]
        ranges = list(result.unit_ranges)
        (chosen,) = [f for f in ties if f[3] == ranges]
        # ties: least total memory, then the most even times
        assert chosen[1:3] == min(f[1:3] for f in ties)
        assert result.stage_memory_bytes == tuple(
            _memory(profiles, s, a, b, in_flight, versions) for s, (a, b) in enumerate(ranges)
        )
        assert max(result.stage_time_s) == result.bottleneck_s


def _uniform(num_blocks: int, *, time_s: float, param_bytes: int, activation_bytes: int):
    return [
        _profile("embed", 0.0, 1, 1),
        *(
            _profile(f"blocks.{i}", time_s, param_bytes, activation_bytes)
            for i in range(num_blocks)
        ),
        _profile("head", 0.0, 1, 1),
    ]


def test_a_binding_memory_limit_changes_the_split_and_is_respected() -> None:
    profiles = _uniform(6, time_s=1.0, param_bytes=10, activation_bytes=100)
    free = partition(profiles, 2)
    limit = max(free.stage_memory_bytes) - 1
    tight = partition(profiles, 2, memory_limit_bytes=limit)
    assert tight.block_ranges != free.block_ranges
    assert all(m <= limit for m in tight.stage_memory_bytes)
    assert tight.bottleneck_s >= free.bottleneck_s
    validate_block_ranges(tight.block_ranges, 6)


def test_first_stages_higher_in_flight_count_pushes_blocks_later() -> None:
    profiles = _uniform(6, time_s=1.0, param_bytes=10, activation_bytes=100)
    limit = 600  # three blocks fit with one microbatch in flight, not with two
    even = partition(profiles, 2, memory_limit_bytes=limit, in_flight=[1, 1])
    one_f_one_b = partition(profiles, 2, memory_limit_bytes=limit)  # default p - s = (2, 1)
    blocks = [[end - start for start, end in r.block_ranges] for r in (even, one_f_one_b)]
    assert blocks[1][0] < blocks[0][0] and blocks[1][1] > blocks[0][1]
    assert all(m <= limit for m in one_f_one_b.stage_memory_bytes)


@pytest.mark.parametrize("in_flight", [[2, 1], [1, 2]])
def test_equal_bottlenecks_go_to_the_split_with_least_memory(in_flight: list[int]) -> None:
    # The free block (no time, large activations) can sit in either stage at no cost in time.
    profiles = [
        _profile("embed", 0.0, 1, 1),
        _profile("blocks.0", 1.0, 1, 1),
        _profile("blocks.1", 0.0, 1, 500),
        _profile("blocks.2", 1.0, 1, 1),
        _profile("head", 0.0, 1, 1),
    ]
    result = partition(profiles, 2, in_flight=in_flight)
    holder = next(s for s, (a, b) in enumerate(result.unit_ranges) if a <= 2 < b)
    assert in_flight[holder] == min(in_flight)
    assert result.bottleneck_s == profiles[1].forward_s + profiles[1].backward_s


def test_infeasible_names_the_least_memory_any_split_needs() -> None:
    profiles = _uniform(4, time_s=1.0, param_bytes=1000, activation_bytes=3000)
    with pytest.raises(PartitionInfeasible) as info:
        partition(profiles, 2, memory_limit_bytes=1000)
    least = info.value.least_bytes
    assert format_bytes(least) in str(info.value) and f"stage {info.value.binding_stage}" in str(
        info.value
    )
    fits = partition(profiles, 2, memory_limit_bytes=least)
    assert max(fits.stage_memory_bytes) == least
    with pytest.raises(PartitionInfeasible):
        partition(profiles, 2, memory_limit_bytes=least - 1)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"num_stages": 7}, "num_stages"),
        ({"num_stages": 2, "in_flight": [1]}, "in_flight"),
        ({"num_stages": 2, "memory_limit_bytes": [5, 5, 5]}, "memory_limit_bytes"),
        ({"num_stages": 2, "weight_versions": [-1, 0]}, "weight_versions"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs: dict, key: str) -> None:
    profiles = _uniform(4, time_s=1.0, param_bytes=1, activation_bytes=1)
    with pytest.raises(ConfigError, match=key):
        partition(profiles, **kwargs)
    with pytest.raises(ConfigError, match="backward_s"):
        LayerProfile(name="x", forward_s=0.0, backward_s=-1.0, param_bytes=0, activation_bytes=0)


# ---------------------------------------------------------------------------------------------
# profiles


def test_gpt_preset_profile_has_embed_blocks_head_with_positive_costs() -> None:
    config = preset("tiny")
    profiles = profile_gpt(config, micro_batch=2, seq_len=config.seq_len)
    names = ["embed", *(f"blocks.{i}" for i in range(config.num_layers)), "head"]
    assert [p.name for p in profiles] == names
    for p in profiles:
        assert p.forward_s > 0 and p.backward_s > 0 and p.param_bytes > 0 and p.activation_bytes > 0
    assert len({(p.forward_s, p.param_bytes, p.activation_bytes) for p in profiles[1:-1]}) == 1
    # fp32 weights; the tied embedding counts in both the first and the last stage's units
    tied = config.vocab_size * config.d_model if config.tie_embeddings else 0
    model = build_gpt(config, device="meta")
    assert sum(p.param_bytes for p in profiles) == 4 * (num_params(model) + tied)
    doubled = profile_gpt(config, micro_batch=4, seq_len=config.seq_len)
    assert doubled[1].activation_bytes == 2 * profiles[1].activation_bytes
    assert doubled[1].forward_s > profiles[1].forward_s


def test_profile_decoder_of_a_gpt_matches_profile_gpt_and_measures_on_request() -> None:
    config = GPTConfig(vocab_size=32, seq_len=8, num_layers=3, num_heads=2, d_model=16)
    model = build_gpt(config)
    analytic = profile_decoder(model, micro_batch=2, seq_len=8)
    assert analytic == profile_gpt(config, micro_batch=2, seq_len=8)
    measured = profile_decoder(model, micro_batch=2, seq_len=8, measure=True, repeats=1)
    assert [p.name for p in measured] == [p.name for p in analytic]
    assert all(p.forward_s > 0 and p.backward_s > 0 for p in measured)
    assert [(p.param_bytes, p.activation_bytes) for p in measured] == [
        (p.param_bytes, p.activation_bytes) for p in analytic
    ]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_profiles_partition_into_ranges_split_model_accepts(kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
            bos_token_id=0, eos_token_id=1, attn_implementation="sdpa",
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(
            vocab_size=40, n_embd=16, n_layer=3, n_head=2, n_positions=16,
            bos_token_id=0, eos_token_id=1, attn_implementation="sdpa",
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    profiles = profile_decoder(model, micro_batch=2, seq_len=8)
    assert [p.name for p in profiles] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert all(p.forward_s > 0 and p.activation_bytes > 0 for p in profiles)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.lm_head.weight.nbytes if kind == "gpt2" else 0
    assert sum(p.param_bytes for p in profiles) == weights + tied
    result = partition(profiles, 5)  # one unit per stage: embedding-only and head-only stages
    stages = split_model(model, result.block_ranges)
    assert [s.block_range for s in stages] == list(result.block_ranges)
    idx = torch.randint(0, 40, (2, 8))
    x = idx
    for stage in stages:
        x = stage(x, idx) if stage.is_last else stage(x)
    assert x.ndim == 0 and torch.isfinite(x)
