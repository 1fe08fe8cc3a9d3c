"""What bdlora's pipelines share (``ship`` running commands as processes, ``sweep`` calling them in-process): a step
as a command and its settings, what it reads and what it writes, and the digest-checked ledger that decides, on a
rerun, which steps are kept (``ledger``)."""
