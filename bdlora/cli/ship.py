"""``bdlora ship``: which folder to ship, answered by one resumable command."""

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from bdlora.base.outputs import check_resumable_out
from bdlora.base.runs import RUNS_DIR, SHIP_PLOT, SHIP_REPORT, SHIP_RESULT
from bdlora.base.threads import from_options
from bdlora.cli.app import command, err, out
from bdlora.cli.options import Json, Out, RunsDir, from_dataclass, given
from bdlora.cli.progress import RichReporter
from bdlora.cli.spell import spell
from bdlora.data.documents import BUILTIN
from bdlora.ship.config import ShipConfig
from bdlora.ship.run import run_ship

SHIP_PANELS = {  # ship --help: what to ship and against what stays in the main panel
    "Healing the candidates": ("student_quant", "draft_speedup", "heal_steps", "heal_time_budget", "heal_batch_size",
                               "heal_seq_len"),
    "Timing and quality": ("quality_tokens", "repeats", "decode_tokens", "seq_len", "threads"),
}


@command(options=from_dataclass(ShipConfig, defaults=True, panels=SHIP_PANELS))
def ship(
    model: Annotated[str, typer.Argument(help="The teacher: builtin (the embedded default), a preset "
                                              "(smollm2-135m, gemma3-270m), a Hugging Face folder or a .gguf file.")]
    = BUILTIN,
    out_dir: Out = None,
    runs_dir: RunsDir = RUNS_DIR,
    json_out: Json = False,
    **opts,
):
    """Which folder should I ship? Exports the teacher at --precision with each scheme (keeps the best), makes
    students at a few predicted speed-ups and the teacher's draft, optionally heals them and the dense teacher,
    benches every folder side by side on two domains (and the teacher speculating with prompt lookup and the draft:
    its own output), and writes, for each perplexity tolerance, the fastest folder within it and the commands that
    rebuild it, or "the teacher's own export" when nothing beats it. Each step is its own bdlora command, its output
    and log kept under --out (default RUNS_DIR/ship-MODEL-PRECISION); running the same command again resumes."""
    cfg = from_options(ShipConfig, given(opts))
    cfg.validate()
    name = Path(model).name.removesuffix(".gguf") if ("/" in model or model.endswith(".gguf")) else model
    folder = Path(out_dir) if out_dir else Path(runs_dir) / f"ship-{name}-{cfg.precision}"
    check_resumable_out(folder)
    result = run_ship(model, cfg, folder, spell, RichReporter(err))
    if json_out:
        out.print_json(json.dumps(result))
        return
    out.print((folder / SHIP_REPORT).read_text(), highlight=False, soft_wrap=True)
    out.print(f"[green]wrote[/] {escape(str(folder))}/{SHIP_REPORT}, {SHIP_RESULT}, {SHIP_PLOT}")
