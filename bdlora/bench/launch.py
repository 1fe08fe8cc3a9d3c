"""The one launcher of the bench's timing processes (``bench.worker`` for onnxruntime, ``bench.genai_worker`` for
onnxruntime-genai): each timing runs in its own process so that nothing of the parent (torch's thread pool, the
exporter's memory) competes with the graphs being timed."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from bdlora.base.children import dying_with_this_process
from bdlora.base.errors import BdloraError
from bdlora.base.reporter import SILENT, Reporter
from bdlora.bench.specs import Spec


def run_timing_process(spec: Spec, name: str, workdir: Path, is_progress: Callable[[str], bool],
                       reporter: Reporter = SILENT, what: str = "bench timing") -> dict:
    """Write ``spec`` to ``workdir/<name>-spec.json``, run its worker (``python -m <spec.MODULE> SPEC OUT``) and
    return the JSON it wrote to ``workdir/<name>-times.json``. Lines of its stderr for which ``is_progress`` holds
    are relayed as stages; if it fails, its last lines become the error. An interrupt (Ctrl-C) kills it, and it ends
    with the command however the command ends (``kill -9`` included): no worker outlives the command."""
    spec_path, out_path = workdir / f"{name}-spec.json", workdir / f"{name}-times.json"
    spec_path.write_text(json.dumps(spec.to_json()))
    proc = subprocess.Popen([sys.executable, "-m", spec.MODULE, str(spec_path), str(out_path)],
                            stderr=subprocess.PIPE, text=True, preexec_fn=dying_with_this_process())
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if is_progress(line):
                reporter.stage(f"timed {line.strip()}")
    finally:
        if proc.poll() is None and sys.exc_info()[0] is not None:  # interrupted: do not leave the worker running
            proc.kill()
    if proc.wait() != 0:
        raise BdloraError(f"the {what} process failed: {''.join(lines[-5:]).strip()}")
    return json.loads(out_path.read_text())
