"""``bdlora export hf``: a compressed model folder republished as a clean, shareable folder with a model card.

The folder format itself (and how ``compress`` writes it) is core: ``bdlora.deployed``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from bdlora.base.errors import ModelError
from bdlora.base.io import atomic_dir, write_text
from bdlora.base.outputs import check_out_dir
from bdlora.base.runs import ModelDir
from bdlora.export.card import model_card
from bdlora.models.integrity import check_model_folder


def export_hf(model_dir: Path, out: Path, force: bool = False) -> Path:
    """Copy a compressed model folder into a clean, shareable folder with a generated model card."""
    src = ModelDir(model_dir)
    if not src.finished():
        raise ModelError(f"{src.path}: not a bdlora model folder (needs config.json and compression.json; "
                         "run `bdlora compress` first)")
    check_out_dir(out, force, (src.path,))
    report = src.report()
    check_model_folder(src.path, report)  # never publish a damaged folder
    with atomic_dir(out) as tmp:
        for f in sorted(src.path.iterdir()):
            if f.is_file() and not f.name.startswith("."):
                shutil.copy(f, tmp / f.name)
        write_text(tmp / "README.md", model_card(report))
    return out
