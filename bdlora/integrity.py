"""Integrity of a model folder before anything reads or republishes it: safetensors files whose header matches their
size, a ``config.json`` that is a JSON object naming a model type, and (for folders bdlora wrote) the SHA-256 of
every weight file recorded in ``compression.json`` at save time. Standard library only.

A half-copied or edited weight file would otherwise load with random or garbage weights (transformers only warns)
or be republished by ``export hf`` as if it were whole.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from bdlora.errors import ModelError

DIGEST_KEY = "weights_sha256"  # in compression.json: {file name: hex digest}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own bound on the JSON header


def sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).glob("*.safetensors") if p.is_file())


def digests(folder: Path) -> dict[str, str]:
    """{file name: SHA-256} of every weight file of ``folder`` (recorded by ``save_model_folder``)."""
    return {p.name: sha256(p) for p in weight_files(folder)}


def check_safetensors(path: Path) -> set[str]:
    """The file is a safetensors file whose header parses and whose tensors end exactly at the end of the file;
    returns its tensor names."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if not 0 < n <= min(_MAX_HEADER, size - 8):
                raise ValueError("header length out of range")
            header = json.loads(f.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError, AttributeError) as e:
        raise ModelError(f"{path}: not a valid safetensors file ({type(e).__name__}); the folder is damaged") from None
    if 8 + n + max(ends, default=0) != size:
        raise ModelError(f"{path}: {size} bytes, but its header describes {8 + n + max(ends, default=0)} (truncated "
                         "or padded); the folder is damaged")
    return {k for k in header if k != "__metadata__"}


def check_declared_forms(folder: Path, cfg: dict, names: set[str]) -> None:
    """Every projection ``bdlora_modules`` declares has exactly the tensors of its form (dense: ``weight``; low-rank:
    ``proj_in.weight`` and ``proj_out.weight``): an edited form would otherwise load randomly initialised."""
    problems = []
    for module, spec in (cfg.get("bdlora_modules") or {}).items():
        lowrank = isinstance(spec, dict) and spec.get("form") == "lowrank"
        want = {f"{module}.proj_in.weight", f"{module}.proj_out.weight"} if lowrank else {f"{module}.weight"}
        other = {f"{module}.weight"} if lowrank else {f"{module}.proj_in.weight", f"{module}.proj_out.weight"}
        if not want <= names or other & names:
            problems.append(f"{module} is declared {'lowrank' if lowrank else 'dense'}")
    if problems:
        raise ModelError(f"{folder}: the weights do not match config.json ({'; '.join(problems[:3])}"
                         f"{' ...' if len(problems) > 3 else ''}, its tensors say otherwise); the folder is damaged "
                         "or its config was edited")


def check_config(folder: Path) -> dict:
    f = Path(folder) / "config.json"
    try:
        cfg = json.loads(f.read_text())
    except FileNotFoundError:
        raise ModelError(f"{folder}: no config.json (not a model folder)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelError(f"{f}: not valid JSON ({type(e).__name__}); the folder is damaged") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise ModelError(f"{f}: not a model config (a JSON object with a model_type); the folder is damaged")
    return cfg


def check_model_folder(folder: Path, report: dict | None = None) -> None:
    """Everything above; ``report`` is the folder's compression.json (its recorded digests, when present)."""
    folder = Path(folder)
    cfg = check_config(folder)
    files = weight_files(folder)
    if not files:
        raise ModelError(f"{folder}: no .safetensors weights (bdlora reads and writes safetensors only)")
    names: set[str] = set()
    for p in files:
        names |= check_safetensors(p)
    check_declared_forms(folder, cfg, names)
    recorded = (report or {}).get(DIGEST_KEY)
    if not recorded:
        return
    found = {p.name for p in files}
    if set(recorded) != found:
        raise ModelError(f"{folder}: weight files {sorted(found)} differ from those recorded at save time "
                         f"{sorted(recorded)}; the folder is damaged")
    for name, want in recorded.items():
        if sha256(folder / name) != want:
            raise ModelError(f"{folder / name}: its SHA-256 differs from the one recorded in compression.json; the "
                             "weights were changed or damaged after saving")
