"""Per-stage step timing, a switch (``DecodeConfig.profile_stages``: on in benchmarks and
``generate``, off in ``ddtree serve`` unless ``--profile-stages``). The clock is chosen once:
profiling on CUDA it synchronises before every reading (so a stage owns the kernels it
launched), on CPU it reads ``perf_counter`` only. Not profiling, it reads the step's start
and end only, never synchronises, and charges the whole step to ``other``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ddtree.vocab import STEP_STAGES, Stage


@dataclass
class StepTimings:
    """Seconds of one decode step by stage (``STEP_STAGES``); ``other`` = step - named."""

    step_s: float
    stage_s: dict[Stage, float]
    tau: int


@dataclass
class StageClock:
    """Stamps named stages of one step: ``begin()``, then ``mark(stage)`` after each stage."""

    sync_cuda: bool
    profile: bool = True  # False: no stage marks, the step is all "other"
    _t0: float = 0.0
    _last: float = 0.0
    _stage_s: dict[Stage, float] = field(default_factory=dict)

    @staticmethod
    def for_device(device: torch.device | str, profile: bool = True) -> StageClock:
        return StageClock(
            sync_cuda=profile and torch.device(device).type == "cuda", profile=profile
        )

    def _now(self) -> float:
        if self.sync_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def begin(self) -> None:
        self._t0 = self._last = self._now()
        self._stage_s = dict.fromkeys(STEP_STAGES, 0.0)

    def mark(self, stage: Stage | str) -> None:
        """Charge the time since the last mark to ``stage`` (a ``Stage`` or its name)."""
        if not self.profile:
            return
        now = self._now()
        self._stage_s[Stage(stage)] += now - self._last
        self._last = now

    def end(self, tau: int) -> StepTimings:
        now = self._now()
        self._stage_s[Stage.OTHER] += now - self._last
        return StepTimings(step_s=now - self._t0, stage_s=self._stage_s, tau=tau)
