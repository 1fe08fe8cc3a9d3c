"""Compression: the one-shot (``oneshot``, its settings in ``config``) over the forms of ``bdlora.forms``, the
knapsack that allocates a budget among their options (``allocate``), calibration statistics (``calibrate``) and
sequential correction (``correct``), the paper's plan (``plan``, ``bounds``), and compressing a finished run
(``run``, each method's own step). Above the core; beside ``train``; below the exporters."""
