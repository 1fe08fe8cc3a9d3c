"""What an export checks before it loads anything (a 1B model takes minutes to load and emit): the tokenizer loads
and names an EOS token (generation stops on it, and genai_config.json declares it: a tokenizer without one was
refused only after three minutes of work), and the output's file system has room for what the export writes (its
graph, and for a rounded precision the fp32 reference graph it validates against, in the temp folder beside it).
The weights themselves are checked by the loader (``models.integrity``) before they are read."""

from __future__ import annotations

import math
from pathlib import Path

from bdlora.base.errors import ModelError, UsageError
from bdlora.base.outputs import free_space
from bdlora.base.runs import CONFIG, STUDENT_META
from bdlora.models.integrity import check_loadable, check_safetensors, weight_files

FLOAT_BYTES = 4  # every export emits fp32 first
HEADROOM = 1.10  # scales and zero points of rounded weights, graph protobuf, tokenizer and config files
SPARE = 64 << 20  # bytes kept free beyond the estimate


def weight_count(folder: Path) -> int:
    """Weights in the folder's safetensors files, read from their headers (nothing is loaded); 0 without any."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in weight_files(folder):
        shapes.update(check_safetensors(f))
    return sum(math.prod(s) for s in shapes.values())


def bytes_needed(weights: int, bits: int, reference: bool) -> int:
    """What an export of ``weights`` at ``bits`` per weight writes (``reference``: an fp32 graph beside it)."""
    return int(weights * (bits / 8 * HEADROOM + (FLOAT_BYTES if reference else 0))) + SPARE


def check_export_inputs(model_dir: Path, out: Path, bits: int, reference: bool) -> None:
    """The tokenizer and the free space for ``out``, in one line each, before the model is loaded."""
    from transformers import AutoTokenizer

    if not (model_dir / CONFIG).is_file() or (model_dir / STUDENT_META).exists():
        return  # not a model folder, or a run's student/: the loader's own one line names what it is
    check_loadable(model_dir)  # the tokenizer reads config.json too: a damaged one is named as the loader names it
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # noqa: BLE001  tokenizers' and transformers' own errors: one line either way
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        raise ModelError(f"{model_dir}: its tokenizer does not load ({type(e).__name__}: {first})") from None
    if tok.eos_token_id is None:
        raise ModelError(f"{model_dir}: its tokenizer names no EOS token (generation stops on it and the runtime's "
                         "config declares it); set eos_token in tokenizer_config.json")
    need = bytes_needed(weight_count(model_dir), bits, reference)
    _, free = free_space(out.parent)
    if need > free:
        raise UsageError(f"--out {out}: the export writes about {need / 2**30:,.1f} GiB there and its file system "
                         f"has {free / 2**30:,.1f} GiB free (free some, or choose another place)")
