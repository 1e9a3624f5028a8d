"""How the CPU's OpenMP threads wait: set before torch loads, by the app and `engine.bench`.

torch's CPU kernels run on OpenMP threads that meet at a barrier after every op. By default
GNU OpenMP spins at the barrier (GOMP_SPINCOUNT, about 300,000 turns) before it sleeps.
That is fastest on an idle machine and disastrous on a busy one: when another program holds
one of two cores, a thread spinning for a peer that is not running burns its own time
slice, and every op waits a scheduler tick. Under such load (issue #20) decode steps went
from 25 ms to 1,460 ms; with OMP_WAIT_POLICY=PASSIVE they stayed at 27-30 tok/s.

The policy here is what `bench peer --busy-cores` measured best on both quiet and busy
runs (README, "Every CPU"). A value the user set in the environment wins. It must be in
the environment before the OpenMP runtime starts, so the entry points call `apply()` before
they import torch; later it only reports (`describe`).
"""
from __future__ import annotations

import os
import sys

POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}
_OURS = "WORKBENCH_THREAD_POLICY_SET"     # which names apply() set (so a child can drop them)


def apply() -> None:
    """Put the policy in the environment, unless the user chose a value or torch is loaded
    already (OpenMP read the environment then; changing it now would only mislead)."""
    if "torch" in sys.modules:
        return
    ours = [name for name in POLICY if name not in os.environ]
    for name in ours:
        os.environ[name] = POLICY[name]
    if ours:
        os.environ[_OURS] = ",".join(ours)


def peer_environment() -> dict[str, str]:
    """This process's environment less what apply() added: a peer server (llama-server, which
    runs on OpenMP too) runs with its own defaults, as its users run it; a value the user set
    reaches it unchanged."""
    ours = set(filter(None, os.environ.get(_OURS, "").split(",")))
    return {name: value for name, value in os.environ.items() if name not in ours and name != _OURS}


def describe() -> str:
    """The policy in effect, as "OMP_WAIT_POLICY=PASSIVE" (or "unset")."""
    return ", ".join(f"{name}={os.environ.get(name, 'unset')}" for name in POLICY)
