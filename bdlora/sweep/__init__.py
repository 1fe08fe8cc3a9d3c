"""``bdlora sweep``: train, compress, evaluate and bench a family of members with everything else held fixed.

- ``options``: ``SweepOptions`` and the members they define (light: the CLI reads its defaults here);
- ``run``: the resumable stages per member and the teacher's reference evaluation;
- ``report``: the per-member rows, ``sweep.md`` and ``pareto.png``.
"""
