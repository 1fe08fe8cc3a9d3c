"""``bdlora ship``: which folder to ship. ``config``: its settings; ``run``: its steps (each a bdlora command, run
and resumed in its own process); ``recommend``: the answer per quality tolerance, its table and picture."""
