"""What every other package stands on: typed errors and their one-line checks (``errors``), atomic files and
safetensors (``io``), every artefact's file names and kinds (``runs``), a new output's folder rules (``outputs``),
progress (``reporter``), plots, and the tables names are compared against (``schemes``: rounding schemes and
precisions; ``method_table``: the training methods' traits). Imports nothing above it."""
