"""Progress on the terminal: the ``Reporter`` of every long command, drawn with rich."""

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from bdlora.base.reporter import Reporter


class RichReporter(Reporter):
    """Progress bar with loss, ppl, tokens/s and ETA; stage lines for the slow set-up steps."""

    def __init__(self, console: Console):
        self.c = console
        self.progress: Progress | None = None
        self.task = None
        self.tprogress: Progress | None = None

    def stage(self, message: str) -> None:
        self._close_teacher()
        self.c.print(f"[cyan]>[/] {escape(message)}")

    def teacher_step(self, step, total, loss):
        if self.tprogress is None:
            self.tprogress = Progress(TextColumn("  teacher"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(),
                                      TimeRemainingColumn(), console=self.c)
            self.tprogress.start()
            self.ttask = self.tprogress.add_task("teacher", total=total, loss=loss)
        self.tprogress.update(self.ttask, completed=step, loss=loss)

    def _close_teacher(self):
        if self.tprogress is not None:
            self.tprogress.stop()
            self.tprogress = None

    def start(self, total_steps, start_step):
        self._close_teacher()
        self.progress = Progress(
            TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
            TextColumn("ppl {task.fields[ppl]}"), TextColumn("{task.fields[extra]}"),
            TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=self.c)
        self.progress.start()
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, loss="-", ppl="-",
                                           tps="-", extra="")

    def step(self, step, m):
        extra = f"dense {m['retained']:.2f}" if "retained" in m else ""
        fields = {"loss": f"{m['loss']:.3f}", "tps": f"{m['tokens_per_s']:.0f}", "extra": extra}
        if "val_ppl" in m:
            fields["ppl"] = f"{m['val_ppl']:.2f}"
        self.progress.update(self.task, completed=step, **fields)

    def evaluated(self, step, m):
        self.c.print(f"  step {step}: val ppl {m['val_ppl']:.3f}"
                     + (f", retained dense {m['retained']:.3f}" if "retained" in m else ""))

    def finish(self):
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def count(self, done: int, total: int, label: str = "prompts") -> None:
        """Progress of a countable job (eval prompts); ``done`` is the increment, 0 opens the bar."""
        if self.progress is None or done == 0:
            self.finish()
            self.progress = Progress(TextColumn(f"  {label}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.c)
            self.progress.start()
            self.task = self.progress.add_task(label, total=total)
        self.progress.advance(self.task, done)
        if self.progress.tasks[0].completed >= total:
            self.finish()
