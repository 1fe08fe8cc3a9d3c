"""``bdlora sweep``: train, compress, evaluate and bench a family of members with everything else held fixed.

- ``options``: ``SweepConfig`` and the members they define (light: the CLI reads its defaults here);
- ``run``: the resumable stages per member and the teacher's reference evaluation;
- ``report``: the per-member rows, ``sweep.md`` and ``pareto.png``;
- ``vary``: the ``--vary`` ablation grid (train options, and compress thresholds that re-compress, not retrain);
- ``paper``: the paper's Table 5 / Table 9 / Figure 2 outputs, and ``sweep-merge`` across teachers.
"""
