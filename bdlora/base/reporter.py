"""Progress callbacks of long-running library functions. Library code never prints: it calls a ``Reporter``;
the CLI passes one that draws rich progress bars (``bdlora.cli.progress.RichReporter``)."""

from __future__ import annotations


class Reporter:
    """Every hook is optional; the base class ignores them all."""

    def stage(self, message: str) -> None:
        """A line saying what starts now (loading, tokenising, evaluating...)."""

    def teacher_step(self, step: int, total: int, loss: float) -> None:
        """Pretraining progress of the embedded default teacher."""

    def start(self, total_steps: int, start_step: int) -> None:
        """Training starts (or resumes at ``start_step``)."""

    def step(self, step: int, metrics: dict) -> None:
        """After every optimiser step, with that step's metrics record."""

    def evaluated(self, step: int, metrics: dict) -> None:
        """After a validation pass (``metrics`` has ``val_ppl``)."""

    def finish(self) -> None:
        """Training stopped (finished, failed or interrupted)."""

    def count(self, done: int, total: int, label: str = "prompts") -> None:
        """Progress of a countable job; ``done`` is the increment, 0 opens the bar."""


SILENT = Reporter()
