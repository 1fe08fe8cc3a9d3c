"""``bdlora generate``: continue a prompt with an exported model, speculatively with ``--draft`` or
``--prompt-lookup``."""

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from bdlora.base.errors import Checks, UsageError
from bdlora.base.runs import RUNS_DIR, GenaiDir
from bdlora.base.threads import from_options
from bdlora.cli.app import command, err, out
from bdlora.cli.options import Json, RunsDir, from_dataclass
from bdlora.speculative.config import SpeculationConfig
from bdlora.speculative.run import GenerateConfig, generate_text

SPECULATION_PANEL = "Speculative decoding"


@command(options=from_dataclass(GenerateConfig, defaults=True)
         + from_dataclass(SpeculationConfig, defaults=True, panel=SPECULATION_PANEL))
def generate(
    model_dir: Annotated[Optional[str], typer.Argument(help="A `bdlora export genai` folder (default: the latest) or "
                                                            "a `bdlora export onnx` folder.")] = None,
    prompt: Annotated[Optional[str], typer.Option(help="The text to continue.")] = None,
    prompt_file: Annotated[Optional[str], typer.Option(help="Read the prompt from this file.")] = None,
    compare: Annotated[bool, typer.Option(help="Also generate without speculation: are the tokens identical, how "
                                               "much faster was it?")] = False,
    runs_dir: RunsDir = RUNS_DIR,
    json_out: Json = False,
    **opts,
):
    """Continue a prompt with an exported model; with --draft FOLDER (a student of the same teacher) or
    --prompt-lookup, speculatively: the proposals are verified by the model, so the output is its own (greedy: the
    same tokens; sampling: the same distribution)."""
    spec = SpeculationConfig(**{k: opts.pop(k) for k in list(opts) if k in SpeculationConfig.__dataclass_fields__})
    cfg = from_options(GenerateConfig, opts)
    if (prompt is None) == (prompt_file is None):
        raise UsageError("give --prompt TEXT or --prompt-file PATH (one of them)")
    if prompt_file is not None:
        try:
            prompt = Path(prompt_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {prompt_file}: cannot read it ({type(e).__name__})") from None
    cfg.check(spec.check(Checks())).done()
    folder = Path(model_dir) if model_dir else GenaiDir.latest(runs_dir).path
    result = generate_text(folder, prompt, cfg, spec, compare=compare)
    if json_out:
        out.print_json(json.dumps(result))
        return
    out.print(escape(result["text"]), highlight=False, soft_wrap=True)
    err.print(summary_table(result))


def summary_table(r: dict) -> Table:
    t = Table(title=f"generate {escape(r['folder'])} ({r['runtime']})", show_header=False)
    t.add_column("", style="bold")
    t.add_column("", justify="right")
    s = r["stats"]
    t.add_row("tokens", f"{len(r['tokens'])} (prompt {r['prompt_tokens']})")
    t.add_row("tokens/s", f"{r['tokens_per_second']:.1f}")
    if r["proposer"]:
        t.add_row("proposer", escape(r["draft"] or r["proposer"]))
        t.add_row("acceptance", f"{s['acceptance']:.1%} ({s['accepted']} of {s['evaluated']} examined)")
        t.add_row("tokens per target call", f"{s['tokens_per_target_call']:.2f}")
        t.add_row("k per round", ", ".join(f"{k}: {n}" for k, n in s["k"].items()))
    if "plain" in r:
        t.add_row("plain tokens/s", f"{r['plain']['tokens_per_second']:.1f}")
        t.add_row("speed-up", f"{r['speedup']:.2f}x")
        same = "yes" if r["identical"] else f"no: first difference at token {r['identical_prefix']}"
        if r.get("temperature"):
            same = f"{same} (sampled: the same distribution, not the same tokens)"
        t.add_row("identical to plain", same)
    return t
