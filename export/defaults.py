"""Defaults of the exporters, in a module that imports nothing (so the torch-free CLI shows them in ``--help``
and the exporters read the same values)."""

DEFAULT_OPSET = 17  # ONNX opset of `export onnx`
MIN_OPSET = 14  # the plain layout's ops (Split/Unsqueeze/ReduceSum with input axes, LessOrEqual) need >= 13
MAX_OPSET = 21  # the newest opset the emitted graphs are checked at (onnxruntime-genai's builder's)
MAX_PPL_CHANGE = 0.10  # `export genai --precision int8|int4`: refused if held-out perplexity rises more than this
# `export genai --threads`: the intra-op thread count a folder asks for, written for the machine it will run on, so not
# bounded by this one's cores; above this it is a typo (100000 made onnxruntime-genai crash with exit 139 on load)
MAX_GENAI_THREADS = 512
GENAI_PRECISION = "fp32"  # `export genai --precision`
QUANT = "rtn"  # `export genai --quant`: round-to-nearest, what onnxruntime-genai's builder does
HEAD_BITS = 8  # `export genai --head-bits`: the LM head's width at int4 (4 is where small models degrade first)
INT8_SHARE = 0.0  # `export genai --int8-share`: none of the int4 projection weights kept at 8 bits
CALIB_TOKENS = 32768  # `export genai --quant gptq`: calibration tokens from the training split (128 blocks of 256)
