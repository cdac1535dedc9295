"""What a resumed run changed of the settings its checkpoint was trained with, in one line.

[Note: resuming with changes]
A resume continues bit for bit ([Note: exact resume] in trainer.py) only under the settings
the checkpoint was trained with, which it keeps (``train_state["config"]``, what config.json
holds). Changing the learning rate, the schedule or the length (``training.steps``, which
stretches the cosine unless ``optimizer.decay_steps`` is set) is done on purpose, to train on
or to cool a run down, so it is allowed and said: one warning naming each change, old to new,
and the learning rate of the next step against the saved schedule's::

    tidal: resuming at step 10 with optimizer.lr 0.0003 (was 0.001), training.steps 20 (was
    10); the next step's learning rate is 2.92e-04 (the saved schedule's: 9.80e-04)

A change of algorithm (``optimizer.name``, or the class of your own torch optimizer) cannot be
honoured: the checkpoint holds the old algorithm's state (AdamW's moments, SGD's momentum),
which the new one cannot take, so it is refused in one line. Checkpoints written before the config was saved in them are not checked.
"""

from __future__ import annotations

from typing import Any

from tidal.config import ConfigError, from_dict
from tidal.parallel.config import OptimizerConfig, TrainingConfig
from tidal.parallel.lr import lr_schedule

__all__ = ["resume_changes"]

# besides every key of [optimizer]: what decides the updates from the resumed step on
_WATCHED = ("training.steps", "training.grad_clip_norm", "user_optimizer", "user_lr_scheduler")
# the algorithm whose state the checkpoint holds (tidal's optimizer's, or your torch class):
# its key, the key an error names and how to resume with it
_ALGORITHM = {
    "optimizer.name": ("optimizer.name", "optimizer.name = {!r}"),
    "user_optimizer_class": ("optimizer", "optimizer={}"),
}


def _settings(config: dict[str, Any]) -> dict[str, Any]:
    """The watched settings of a config.json-shaped dict, by dotted key."""
    out = {f"optimizer.{k}": v for k, v in config.get("optimizer", {}).items()}
    for key in (*_WATCHED, "user_optimizer_class"):
        section, _, name = key.rpartition(".")
        out[key] = config.get(section, {}).get(name) if section else config.get(name)
    return out


def _text(value: Any) -> str:
    if value is None:
        return "unset"
    return f"{value:g}" if isinstance(value, float) else str(value)


def resume_changes(saved: dict[str, Any], current: dict[str, Any], *, step: int) -> str | None:
    """The warning line for what ``current`` changed of ``saved`` (config.json-shaped dicts),
    resuming at ``step``; None if nothing; a :class:`ConfigError` for a change that cannot be
    honoured ([Note: resuming with changes])."""
    if not saved:  # a checkpoint written before the config was kept in it
        return None
    old, new = _settings(saved), _settings(current)
    _check_algorithm(old, new, step=step)
    # your optimizer's class is said as user_optimizer
    mentioned = [key for key in new if key != "user_optimizer_class"]
    changed = [key for key in mentioned if key in old and old[key] != new[key]]
    if not changed:
        return None
    said = ", ".join(f"{key} {_text(new[key])} (was {_text(old[key])})" for key in changed)
    line = f"tidal: resuming at step {step} with {said}"
    rates = _next_rates(saved, current, step=step)
    if rates is not None and rates[0] != rates[1]:
        line += f"; the next step's learning rate is {rates[1]:.2e} (the saved schedule's: {rates[0]:.2e})"
    return line


def _check_algorithm(old: dict[str, Any], new: dict[str, Any], *, step: int) -> None:
    for key, (names, fix) in _ALGORITHM.items():
        if old[key] is not None and new[key] is not None and old[key] != new[key]:
            raise ConfigError(
                names,
                f"the checkpoint at step {step} holds {old[key]}'s optimizer state, which "
                f"{new[key]} cannot take; resume with {fix.format(old[key])}, or start a new run "
                f"(another run_dir)",
            )


def _next_rates(
    saved: dict[str, Any], current: dict[str, Any], *, step: int
) -> tuple[float, float] | None:
    """The learning rate of the step after ``step`` under each config's schedule; None where
    a schedule is yours (a torch scheduler's rates are its own) or a config is not readable."""
    rates = []
    for config in (saved, current):
        if config.get("user_optimizer") or config.get("user_lr_scheduler"):
            return None
        try:
            optimizer = from_dict(OptimizerConfig, config["optimizer"])
            training = from_dict(TrainingConfig, config["training"])
        except (ConfigError, KeyError):  # written by another version of tidal
            return None
        rates.append(lr_schedule(optimizer, training).lr_at(step))
    return rates[0], rates[1]
