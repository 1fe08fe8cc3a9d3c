"""Defaults of the exporters, in a module that imports nothing (so the torch-free CLI shows them in ``--help``
and the exporters read the same values). ``export genai``'s own (precision, rounding, head bits...) are the fields
of ``bdlora.export.settings.GenaiExportConfig``."""

DEFAULT_OPSET = 17  # ONNX opset of `export onnx`
MIN_OPSET = 14  # the plain layout's ops (Split/Unsqueeze/ReduceSum with input axes, LessOrEqual) need >= 13
MAX_OPSET = 21  # the newest opset the emitted graphs are checked at (onnxruntime-genai's builder's)
MAX_CONTEXT = 4096  # rotary tables and the generator's default max_length stop here unless --context-length says more
