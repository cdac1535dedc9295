"""The typed config tree: coercion, errors that name the key, recipes, overrides."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Literal

import pytest

from tidal.config import ByteSize, ConfigError, apply_overrides, from_dict, parse_bytes, to_dict
from tidal.train import JobConfig, list_recipes, load_job


@dataclass(kw_only=True, slots=True)
class _Inner:
    count: int = 1
    ratio: float = 0.5
    budget: ByteSize | None = None
    limit: ByteSize | Literal["auto"] = "auto"
    mode: Literal["a", "b"] = "a"
    flag: bool = False
    betas: tuple[float, float] = (0.9, 0.95)

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError("count", f"must be >= 1, got {self.count}")


@dataclass(kw_only=True, slots=True)
class _Outer:
    name: str = "x"
    inner: _Inner = field(default_factory=_Inner)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5KiB", 1536),
        ("4096", 4096),
        (1024, 1024),
        ("3 gib", 3 * 2**30),
    ],
)
def test_parse_bytes_units(text: object, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["-1GB", "12 parsecs", "", True, -5])
def test_parse_bytes_rejects(bad: object) -> None:
    with pytest.raises(ConfigError, match="k.budget"):
        parse_bytes(bad, key="k.budget")


def test_from_dict_builds_nested_and_coerces_cli_strings() -> None:
    cfg = from_dict(
        _Outer,
        {"name": "run", "inner": {"count": "7", "ratio": "1e-3", "budget": "1MiB", "limit": "2KB",
                                  "mode": "b", "flag": "true", "betas": "0.8,0.99"}},
    )  # fmt: skip
    assert cfg.inner.count == 7
    assert cfg.inner.ratio == pytest.approx(1e-3)
    assert cfg.inner.budget == 2**20 and cfg.inner.limit == 2000
    assert from_dict(_Inner, {"limit": "auto"}).limit == "auto"
    assert cfg.inner.mode == "b" and cfg.inner.flag is True
    assert cfg.inner.betas == (0.8, 0.99)
    assert from_dict(_Outer, {"inner": {"budget": "none"}}).inner.budget is None


def test_unknown_key_names_path_and_suggests() -> None:
    with pytest.raises(ConfigError) as err:
        from_dict(_Outer, {"inner": {"cuont": 3}})
    assert err.value.key == "inner.cuont"
    assert "did you mean 'count'" in str(err.value)


@pytest.mark.parametrize(
    ("data", "key", "fragment"),
    [
        ({"inner": {"count": "abc"}}, "inner.count", "expected an integer"),
        ({"inner": {"count": True}}, "inner.count", "expected an integer"),
        ({"inner": {"count": 0}}, "inner.count", "must be >= 1"),
        ({"inner": {"mode": "c"}}, "inner.mode", "expected one of 'a', 'b'"),
        ({"inner": {"budget": "-2GB"}}, "inner.budget", "cannot be negative"),
        ({"inner": {"limit": "lots"}}, "inner.limit", "'auto'"),
        ({"inner": 3}, "inner", "expected a table"),
        ({"name": 5}, "name", "expected a string"),
    ],
)
def test_wrong_values_name_the_key(data: dict, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict(_Outer, data)
    assert err.value.key == key
    assert fragment in str(err.value)


def test_overrides_set_nested_values_and_reject_malformed() -> None:
    data = apply_overrides({"training": {"steps": 5}}, ["training.steps=50", "name=abc"])
    assert data == {"training": {"steps": "50"}, "name": "abc"}
    for bad in ["training.steps", "=3", "a..b=1"]:
        with pytest.raises(ConfigError, match="KEY=VALUE"):
            apply_overrides({}, [bad])
    with pytest.raises(ConfigError, match="not a table"):
        apply_overrides({"name": "x"}, ["name.sub=1"])


def test_every_recipe_loads_and_round_trips() -> None:
    names = list_recipes()
    assert {"demo", "tiny", "gpt2-small"} <= set(names)
    for name in names:
        job = load_job(name)
        assert isinstance(job, JobConfig)
        assert from_dict(JobConfig, to_dict(job)) == job


def test_job_overrides_and_errors() -> None:
    job = load_job("tiny", ["training.steps=7", "memory.device_budget=2GiB"])
    assert job.training.steps == 7
    assert job.memory.device_budget == 2 * 2**30
    with pytest.raises(ConfigError, match="training.stepz: unknown key"):
        load_job("tiny", ["training.stepz=7"])
    with pytest.raises(
        ConfigError, match=r"training.lr: unknown key \(allowed: .*\); lr is optimizer.lr$"
    ):
        load_job("tiny", ["training.lr=1e-3"])  # a key of another section: where it lives
    with pytest.raises(ConfigError, match=r"\); steps is training.steps$"):
        load_job("tiny", ["optimizer.steps=7"])  # rather than "did you mean 'eps'?"
    with pytest.raises(ConfigError, match="unknown recipe 'nope'.*tiny"):
        load_job("nope")
    with pytest.raises(ConfigError, match="model.preset"):
        load_job("tiny", ["model.preset=gpt5"])
    with pytest.raises(ConfigError, match="training.precision"):
        load_job("tiny", ["training.precision=fp8"])


def test_config_error_survives_pickling() -> None:
    # Errors raised in worker processes (benchmarks, ranks) travel to the parent pickled.
    err = pickle.loads(pickle.dumps(ConfigError("training.steps", "must be >= 1, got 0")))
    assert isinstance(err, ConfigError)
    assert err.key == "training.steps" and str(err) == "training.steps: must be >= 1, got 0"
