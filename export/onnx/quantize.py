"""Graph pass: onnxruntime dynamic int8 weight quantisation (``export onnx --quantize int8``), keeping the bdlora
metadata. Activations stay fp32; MatMul weights become int8 with per-tensor scales."""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
from onnxruntime.quantization import QuantType, quantize_dynamic
from onnxruntime.quantization.shape_inference import quant_pre_process

from bdlora.export.onnx.metadata import read_metadata, set_metadata


def quantize_int8(src: Path, dst: Path) -> None:
    """onnxruntime dynamic int8 weight quantisation (shape inference first), keeping the bdlora metadata."""

    pre = dst.with_suffix(".pre.onnx")
    try:
        quant_pre_process(str(src), str(pre), skip_optimization=True, skip_symbolic_shape=True)
        # contrib ops (--optimize's fused norms and rotary) have no ONNX type inference: their outputs are fp32
        # activations, and the quantizer's per-tensor warnings about them (on the root logger) say nothing actionable
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)
        try:
            quantize_dynamic(str(pre), str(dst), weight_type=QuantType.QInt8,
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        finally:
            root.setLevel(level)
    finally:
        if pre.exists():
            pre.unlink()
    q = onnx.load(str(dst))
    set_metadata(q, read_metadata(src))
    onnx.save(q, str(dst))
