"""Training: the loop (``loop``) and its session (``session``: teacher, data, student), the settings (``config``,
``option_files``: recipes and YAML), the methods' strategies (``methods``), distillation losses and the KD cache
(``distill``, ``kdcache``), stopping (``stopping``: best step, time budget), mixture reweighting (``reweight``),
checkpoints, several processes (``distributed``), the student's warm start (``student``, ``forms_start``), and the
paper's training method (``budgeted``: the budget controller and the gated start). Above the core; beside
``compress``; below the exporters."""
