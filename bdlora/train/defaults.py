"""``bdlora train``'s defaults for each kind of teacher, the one home of each value (the help, the eval slice of a
folder without a run and a sweep's one-shot members read them here)."""

from __future__ import annotations

from bdlora.compress.config import CALIB_TOKENS
from bdlora.models.budgeted.config import DEFAULTS as BUDGETED

# Defaults for the embedded default teacher (4.5M parameters, 4 layers, hidden 256): the paper's rank 128 / alpha 256
# and 1024-token sequences would dwarf a hidden size of 256, so rank and alpha keep the paper's alpha/r = 2 at r = 16.
BUILTIN_DEFAULTS = {"seq_len": 128, "max_steps": 600, "lora_rank": 16, "lora_alpha": 32.0,
                    "eval_every": 100, "eval_tokens": 32768, "batch_size": 16, "lora_init": "whitened",
                    "allocation": "quality", "calib_tokens": CALIB_TOKENS}
# Real teachers: the paper's rank 128 / alpha 256, 1024-token sequences and lr 3e-4, but a first-run budget (1000
# steps of 8 x 1024 tokens, 1,048,576 validation tokens), not the paper's 2.55B tokens: that is recipes/paper.yaml.
REAL_DEFAULTS = {"batch_size": 8, "seq_len": 1024, "max_steps": 1000, "lora_rank": BUDGETED.rank,
                 "lora_alpha": BUDGETED.alpha, "eval_every": 200, "eval_tokens": 1 << 20, "lora_init": "whitened",
                 "allocation": "quality", "calib_tokens": CALIB_TOKENS}


def teacher_defaults(builtin: bool) -> dict:
    """The defaults of a run whose teacher is the embedded default (``builtin``) or a real one."""
    return BUILTIN_DEFAULTS if builtin else REAL_DEFAULTS
