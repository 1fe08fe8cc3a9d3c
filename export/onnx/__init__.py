"""ONNX export of a (compressed) student as a decoder with KV cache (SPEC 8), in parts:

- ``signature``: input/output names, dynamic axes, opsets, example inputs;
- ``trace``: the flat-tensor wrapper, the hand-built 4D mask and the TorchScript export;
- ``metadata``: the per-module shape table and summary stored in the graph and on its nodes;
- graph passes ``fuse`` (shared-input MatMuls), ``optimize`` (onnxruntime's fusions), ``quantize`` (int8);
- ``validate``: parity with PyTorch within a stated tolerance, or a typed error;
- ``folder``: ``bdlora export onnx`` (a model folder in, a validated ONNX folder out);
- ``optimum``: loading the folder in optimum's ORTModelForCausalLM (the optional [optimum] extra).

Running the graph (sessions, caches, greedy decoding, scoring) is ``bdlora.runtime``, which needs no torch.
"""

from bdlora.export.onnx.folder import export_onnx_folder
from bdlora.export.onnx.optimum import load_ort_model
from bdlora.export.onnx.trace import export_decoder
from bdlora.export.onnx.validate import ExportValidationError, validate

__all__ = ["ExportValidationError", "export_decoder", "export_onnx_folder", "load_ort_model", "validate"]
