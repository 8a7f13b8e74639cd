"""The decode loop: one loop, pluggable proposal policies (AR, chain, DDTree)."""

from ddtree.engine.loop import ContextLengthError, DecodeConfig, GenerationResult, generate
from ddtree.engine.policies import POLICIES, Policy, get_policy
from ddtree.engine.runrecord import engine_run_record, summarize
from ddtree.engine.timing import StageClock, StepTimings

__all__ = [
    "POLICIES",
    "ContextLengthError",
    "DecodeConfig",
    "GenerationResult",
    "Policy",
    "StageClock",
    "StepTimings",
    "engine_run_record",
    "generate",
    "get_policy",
    "summarize",
]
