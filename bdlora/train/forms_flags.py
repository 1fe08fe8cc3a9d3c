"""``train --forms``: which of the forms a training method can start from and heal (the form registry,
``bdlora.forms``, says what each form is; what a method may do with it is training's)."""

from __future__ import annotations

from bdlora.base.errors import shown
from bdlora.forms import LOWRANK, VOCAB, forms_problem


def train_forms_problems(c, cfg) -> None:
    """``train --forms`` and ``--speedup`` (a ``config.TrainConfig``, whose dials' own rules ``Dials.check`` has
    added): forms the method can train from, one dial; each problem added to ``c`` (an ``errors.Checks``)."""
    d = cfg.dials
    if d.speedup is not None:
        c.require(d.forms is not None and d.precision is not None and d.mac_ratio is None,
                  f"--speedup {shown(d.speedup)}: with --forms F and --precision P, instead of --mac-ratio")
    c.require(d.width_multiple is None or cfg.structured,
              f"--width-multiple {shown(d.width_multiple)}: is the grid of a --forms start's pruned widths; give "
              "--forms channels,groups (or leave it out)")
    if d.forms is None or forms_problem(d.forms) is not None:  # not a known set: Dials.check said so
        return
    names = d.form_names
    c.require(VOCAB.name not in names, f"--forms {d.forms}: vocab is a speculative-decoding draft's head; make "
              "the draft with compress --one-shot --forms ...,vocab and heal it with train --student-init FOLDER")
    if cfg.traits.gated:
        c.require(cfg.allocation != "cost" and LOWRANK.name in names,
                  f"--forms {d.forms}: budgeted moves the projections the allocation makes low rank; give "
                  "--allocation quality and lowrank among the forms (or --method kd-lora to heal a pruned start)")
    else:
        c.require(LOWRANK.name not in names and cfg.structured,
                  f"--forms {d.forms}: {cfg.method} heals a dense structure; name channels, groups, layers or "
                  "bits without lowrank (budgeted moves projections to low rank)")
    c.require(not cfg.traits.gated or cfg.lora_init in (None, "whitened"),
              f"--forms {d.forms}: the start's low-rank paths are the one-shot's whitened factors; --lora-init "
              f"{cfg.lora_init} cannot start them (drop it, or give whitened)")
    c.require(d.forms == LOWRANK.name or d.ratio is not None,
              f"--forms {d.forms}: needs the dial the start allocates for: --mac-ratio R (or --precision P "
              "--speedup S)")
    c.require(not (cfg.structured and cfg.student_init),
              f"--forms {d.forms}: the start prunes the teacher's layers; --student-init {cfg.student_init} "
              "is a structure already (give one or the other)")
