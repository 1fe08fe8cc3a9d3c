"""The llama.cpp rows of ``bdlora bench --runtime llamacpp``: every folder of the front (the benched student, the
teacher, ``--also`` and ``--peer`` folders) written by ``bdlora export gguf`` at each ``--gguf-quants`` type, as a
user who runs llama.cpp, llama-server or Ollama would, and scored in llama.cpp on the front's held-out blocks.

Low-rank modules are multiplied out (llama.cpp has no low-rank form: ``export gguf --merge-lowrank``), which the
row's note says; a folder llama.cpp cannot express (a narrowed vocabulary head, a pruned Gemma 3) gets a note
instead of a row. The files are timed with the genai folders in one process (``bench.genai_worker``), interleaved.
"""

from __future__ import annotations

from pathlib import Path

from bdlora.base.errors import BdloraError
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import MODEL_GGUF, gguf_precision, row_name
from bdlora.base.threads import ThreadPool
from bdlora.export.gguf.folder import export_gguf_folder
from bdlora.export.gguf.llamacpp import perplexity
from bdlora.export.settings import GgufExportConfig


def export_ggufs(sources: dict[str, Path], quants: list[str], work: Path, threads: int,
                 reporter: Reporter = SILENT) -> tuple[dict[str, Path], dict[str, str]]:
    """Every source folder (by front name: compressed, teacher, an --also's, peer-NAME) at every quant as a GGUF
    file: ({row name: file}, {row name: why it has no row, or what was merged})."""
    files: dict[str, Path] = {}
    notes: dict[str, str] = {}
    for name, folder in sources.items():
        for quant in quants:
            key = row_name(name, gguf_precision(quant))
            reporter.stage(f"exporting {key}: bdlora export gguf {folder.name} --quant {quant} --merge-lowrank")
            settings = GgufExportConfig(quant=quant, merge_lowrank=True, validate=False, pool=ThreadPool(threads))
            out = work / key
            try:
                info = export_gguf_folder(folder, out, settings, reporter=reporter)
            except BdloraError as e:  # a structure llama.cpp cannot hold: said beside the front, not fatal
                notes[key] = f"no llama.cpp row: {e}"
                reporter.stage(f"{key}: {notes[key]}")
                continue
            files[key] = out / MODEL_GGUF
            merged = info.get("merged_lowrank") or []
            if merged:
                notes[key] = (f"{len(merged)} low-rank module(s) multiplied out into dense weights (llama.cpp has no "
                              "low-rank form): their speed-up is not in this row")
    return files, notes


def score_ggufs(files: dict[str, Path], blocks, threads: int, reporter: Reporter = SILENT) -> dict[str, dict]:
    """Held-out perplexity of every GGUF file in llama.cpp on ``blocks`` (the genai folders' blocks)."""
    out = {}
    for key, path in files.items():
        reporter.stage(f"held-out perplexity of {key} in llama.cpp ({len(blocks) * blocks.seq_len:,} tokens)")
        out[key] = perplexity(path, blocks, threads, reporter)
    return out
