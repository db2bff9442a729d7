"""The features that plug into the plain engine (engine.py), and the engine a config asks for.

The plain Engine, Scheduler and ModelRunner know no feature. A feature is a subclass of the
Engine in a file of its own, which changes a step at a few named points (Engine's "what a
feature changes") and may bring its own Scheduler and ModelRunner subclasses:

  speculative_config   speculate.py: SpecEngine (drafts checked in a step, branches, rounds)
  sm_split             lanes.py: SplitEngine (a step on two lanes of disjoint SMs)

Each feature's file is loaded only when a config asks for it.
"""

import importlib

from nanopd.config import EngineConfig
from nanopd.engine import Engine

# a config's feature (EngineConfig.features) -> "module:class" of the engine that serves it
FEATURES = {
    "speculative_config": "nanopd.speculate:SpecEngine",
    "sm_split": "nanopd.lanes:SplitEngine",
}


def engine_class(cfg: EngineConfig) -> type[Engine]:
    """The Engine subclass serving every feature cfg asks for (the plain Engine if none)."""
    asked = cfg.features()
    if not asked:
        return Engine
    if len(asked) > 1:   # validate names the settings that exclude each other
        cfg.validate()
        raise ValueError(f"{' and '.join(asked)} cannot be served together")
    module, name = FEATURES[asked[0]].split(":")
    return getattr(importlib.import_module(module), name)


def make_engine(cfg: EngineConfig) -> Engine:
    """The engine cfg asks for: the plain Engine, or the subclass of its feature."""
    return engine_class(cfg)(cfg)
