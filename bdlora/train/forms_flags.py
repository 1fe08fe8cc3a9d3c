"""``train --forms``: which of the forms a training method can start from and heal (the form registry,
``bdlora.forms``, says what each form is; what a method may do with it is training's)."""

from __future__ import annotations

from bdlora.base.errors import shown
from bdlora.forms import LOWRANK, VOCAB, check_forms, check_width_multiple


def train_forms_problems(c, cfg) -> None:
    """``train --forms`` and ``--speedup`` (a ``config.TrainConfig``): a known set of forms the method can train
    from, one dial; each problem added to ``c`` (an ``errors.Checks``)."""
    if cfg.speedup is not None:
        c.require(cfg.forms is not None and cfg.precision is not None and cfg.mac_ratio is None,
                  f"--speedup {shown(cfg.speedup)}: with --forms F and --precision P, instead of --mac-ratio")
    c.require(cfg.width_multiple is None or cfg.structured,
              f"--width-multiple {shown(cfg.width_multiple)}: is the grid of a --forms start's pruned widths; give "
              "--forms channels,groups (or leave it out)")
    check_width_multiple(c, cfg.width_multiple)
    if cfg.forms is None:
        return
    names = check_forms(c, cfg.forms, cfg.precision, cfg.speedup)
    if names is None:
        return
    c.require(VOCAB.name not in names, f"--forms {cfg.forms}: vocab is a speculative-decoding draft's head; make "
              "the draft with compress --one-shot --forms ...,vocab and heal it with train --student-init FOLDER")
    if cfg.traits.gated:
        c.require(cfg.allocation != "cost" and LOWRANK.name in names,
                  f"--forms {cfg.forms}: budgeted moves the projections the allocation makes low rank; give "
                  "--allocation quality and lowrank among the forms (or --method kd-lora to heal a pruned start)")
    else:
        c.require(LOWRANK.name not in names and cfg.structured,
                  f"--forms {cfg.forms}: {cfg.method} heals a dense structure; name channels, groups, layers or "
                  "bits without lowrank (budgeted moves projections to low rank)")
    c.require(not cfg.traits.gated or cfg.lora_init in (None, "whitened"),
              f"--forms {cfg.forms}: the start's low-rank paths are the one-shot's whitened factors; --lora-init "
              f"{cfg.lora_init} cannot start them (drop it, or give whitened)")
    c.require(cfg.forms == LOWRANK.name or cfg.mac_ratio is not None or cfg.speedup is not None,
              f"--forms {cfg.forms}: needs the dial the start allocates for: --mac-ratio R (or --precision P "
              "--speedup S)")
    c.require(not (cfg.structured and cfg.student_init),
              f"--forms {cfg.forms}: the start prunes the teacher's layers; --student-init {cfg.student_init} "
              "is a structure already (give one or the other)")
