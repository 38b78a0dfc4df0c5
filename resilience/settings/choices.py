"""The choices of the settings that the table of rules reads (``resilience.compat``), apart from the schema: a rank
builds its roles and checks them against that table, and the schema's module registers itself with Hydra's
ConfigStore, whose import (all of Hydra) a rank never needs."""

from enum import Enum


class Launcher(str, Enum):  # str: a value compares equal to its name, as the YAML's string did
    local = "local"
    external = "external"
    torchrun = "torchrun"
    ft_launcher = "ft_launcher"


class Rng(str, Enum):
    reseed = "reseed"
    carried = "carried"


class LrSchedule(str, Enum):
    constant = "constant"
    warmup_cosine = "warmup_cosine"


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Data(str, Enum):
    synthetic = "synthetic"
    loader = "loader"
