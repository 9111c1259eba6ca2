"""Every job's config dataclass: its fields are the command-line options, the YAML keys and the Python keywords.

Kept apart from the jobs' run functions (``rope_patch/jobs/<job>.py``) and free of torch and transformers, so that the
command line's parser and ``--help`` are built without them.
"""

from __future__ import annotations

from .demo import DemoConfig
from .eval import EvalConfig
from .export import ExportConfig
from .finetune import FinetuneConfig
from .inspect import InspectConfig
from .lm_eval import LmEvalConfig
from .passkey import PasskeyConfig
from .search import SearchConfig
from .sweep import SweepConfig

__all__ = ["DemoConfig", "EvalConfig", "ExportConfig", "FinetuneConfig", "InspectConfig", "LmEvalConfig",
           "PasskeyConfig", "SearchConfig", "SweepConfig"]
