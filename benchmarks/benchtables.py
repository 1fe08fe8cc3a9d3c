"""What the benchmark scripts share: their ``--folders name=path,...`` argument and the markdown table each writes
(atomically, to ``--out``) and prints."""

from __future__ import annotations

from pathlib import Path

from bdlora.base.io import write_text


def named_folders(spec: str) -> dict[str, Path]:
    """``name=folder,...`` as {name: folder}, in the order given (the first is a table's reference)."""
    return {k: Path(v) for k, v in (x.split("=", 1) for x in spec.split(","))}


def publish(rows: list[str], out: Path) -> None:
    """The table's ``rows`` (header first) written to ``out`` and printed."""
    text = "\n".join(rows) + "\n"
    write_text(out, text)
    print(text)
