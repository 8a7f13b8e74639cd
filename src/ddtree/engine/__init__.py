"""The decode loop: one loop, pluggable proposal policies (AR, chain, DDTree)."""

from ddtree.engine.loop import (
    ContextLengthError,
    DecodeConfig,
    GenerationResult,
    check_context,
    generate,
    prompt_tensor,
    request_positions,
)
from ddtree.engine.runrecord import engine_run_record, summarize
from ddtree.engine.timing import StageClock, StepTimings

__all__ = [
    "ContextLengthError",
    "DecodeConfig",
    "GenerationResult",
    "StageClock",
    "StepTimings",
    "check_context",
    "engine_run_record",
    "generate",
    "prompt_tensor",
    "request_positions",
    "summarize",
]
