"""What a model folder records of where it came from (``compression.json``'s ``provenance``): the run it was made
from, by an absolute and a relative path, and the corpus settings its figures were measured on, so a folder moved
or outliving its run keeps its held-out slice. The folders themselves are ``runs``'."""

from __future__ import annotations

import os
from pathlib import Path

from bdlora.base.runs import source_run


def provenance_paths(run_dir: str | os.PathLike, recorded_in: str | os.PathLike) -> dict:
    """How a folder records the run it came from: absolute, and relative to the recording folder."""
    run, here = Path(run_dir).resolve(), Path(recorded_in).resolve()
    return {"run_dir": str(run), "run_dir_relative": os.path.relpath(run, here)}


def recorded_data_settings(folder: str | os.PathLike, provenance: dict) -> dict | None:
    """The corpus settings a model folder's figures come from (``RunDir.data_settings``): its source run's while it
    exists, else the copy its compression recorded in the provenance (every compression records one, so a folder
    keeps its held-out slice when the run is deleted or the folder moved); None when neither is known."""
    run = source_run(folder, provenance)
    return run.data_settings() if run is not None else provenance.get("data_settings")
