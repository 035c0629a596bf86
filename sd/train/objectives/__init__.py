"""The objectives a run trains by (the contract: ``sd.train.objectives.base``). Each lives in a module of its
own; ``OBJECTIVES`` lists them in the order they are asked ``wanted(config)``: the first that wants a config is
its objective, ``Diffusion`` the default. A new objective is its module and one line here."""

from __future__ import annotations

from sd.train.objectives.base import LossContext, LossSettings, Objective
from sd.train.objectives.diffusion import Diffusion
from sd.train.objectives.dmd import DistributionMatching
from sd.train.objectives.flow import Flow, Reflow
from sd.train.objectives.lcm import LatentConsistency
from sd.train.objectives.preference import DirectPreference

OBJECTIVES: tuple[type[Objective], ...] = (LatentConsistency, DistributionMatching, DirectPreference, Reflow, Flow, Diffusion)

__all__ = ["OBJECTIVES", "LossContext", "LossSettings", "Objective", "check", "objective_of"]


def objective_of(config) -> type[Objective]:
    """The objective ``config`` asks for."""
    return next(objective for objective in OBJECTIVES if objective.wanted(config))


def check(config, check_paths: bool = True) -> None:
    """Every objective's checks of ``config`` (each refuses the settings it cannot train with, and its own
    settings where another objective trains)."""
    for objective in OBJECTIVES:
        objective.check(config, check_paths)
