"""ONNX export of a (compressed) student as a decoder with KV cache (SPEC 8), in parts:

- the graph itself comes from ``bdlora.export.decoder`` (the one emitter, plain layout: position ids, separate
  past/present);
- ``signature``: opsets and the example inputs validation feeds (names and axes: ``bdlora.models.runtime``);
- ``metadata``: the per-module shape table and summary stored in the graph and on its nodes;
- ``quantize``: dynamic int8;
- ``validate``: parity with PyTorch within a stated tolerance, or a typed error;
- ``folder``: ``bdlora export onnx`` (a model folder in, a validated ONNX folder out);
- ``optimum``: loading the folder in optimum's ORTModelForCausalLM (the optional [optimum] extra).

Running the graph (sessions, caches, greedy decoding, scoring) is ``bdlora.models.runtime``, which needs no torch.
"""

from bdlora.export.onnx.folder import export_decoder, export_onnx_folder
from bdlora.export.onnx.optimum import load_ort_model
from bdlora.export.onnx.validate import ExportValidationError, validate

__all__ = ["ExportValidationError", "export_decoder", "export_onnx_folder", "load_ort_model", "validate"]
