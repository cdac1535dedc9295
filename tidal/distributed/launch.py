"""``tidal train --nproc N``: the same command again, as N ranks under torchrun.

The launcher only rebuilds argv and waits; each rank is an ordinary ``python -m tidal train``
that finds torchrun's variables and joins the group (``init_from_env``). So ``--nproc N`` and
``torchrun --nproc-per-node N -m tidal train ...`` run exactly the same code.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

__all__ = ["launch_train", "torchrun_command", "without_flag"]

# How long torchrun gets to stop its ranks after Ctrl-C before it is told to terminate.
_INTERRUPT_GRACE_S = 5.0


def without_flag(argv: Sequence[str], flag: str) -> list[str]:
    """``argv`` without ``flag VALUE`` / ``flag=VALUE``, also in the prefixes argparse accepts
    for it (``--np 2`` for ``--nproc 2``). Tokens after a bare ``--`` are kept as they are."""
    out: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            out.append(token)
            out.extend(tokens)
            break
        name, has_value, _ = token.partition("=")
        # "--" alone is not a prefix argparse would expand; anything longer is, if unique.
        if len(name) > 2 and flag.startswith(name):
            if not has_value:
                next(tokens, None)
            continue
        out.append(token)
    return out


def torchrun_command(train_argv: Sequence[str], *, nproc: int) -> list[str]:
    """torchrun on this machine running ``tidal train`` with ``train_argv`` minus ``--nproc``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "tidal",
        "train",
        *without_flag(train_argv, "--nproc"),
    ]


def launch_train(train_argv: Sequence[str], *, nproc: int) -> int:
    """Run ``tidal train`` as ``nproc`` ranks; return torchrun's exit code.

    ``train_argv`` is what followed ``train`` on the command line. torchrun exits 0 when every
    rank did and 1 when one failed (that rank's error is printed above its report).
    """
    if nproc < 2:
        raise ValueError(f"nproc must be >= 2 to launch ranks, got {nproc}")
    proc = subprocess.Popen(torchrun_command(train_argv, nproc=nproc))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # A terminal's Ctrl-C reached torchrun too, and it is stopping its ranks; a second
        # SIGINT could cut its clean-up short. If the signal came to this process alone, SIGTERM
        # (which torchrun also forwards) stops them. Killing torchrun would orphan its ranks.
        try:
            proc.wait(timeout=_INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait()
        raise
