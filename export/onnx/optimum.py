"""Loading an exported folder in optimum's ``ORTModelForCausalLM`` (``generate()`` over onnxruntime).

optimum's onnxruntime integration (the ``optimum-onnx`` package) is an optional extra: its last release requires
transformers < 4.58, while bdlora runs on the current transformers. ``pip install "bdlora[optimum]"`` brings it
(and transformers 4.57 with it).
"""

from __future__ import annotations

from pathlib import Path

from bdlora.base.errors import UsageError
from bdlora.base.runs import MODEL_ONNX
from bdlora.models.runtime import DecoderShape

EXTRA_HINT = ('needs the optional [optimum] extra: pip install "bdlora[optimum]" (optimum-onnx; it installs '
              "transformers 4.57, which bdlora also supports)")


def load_ort_model(onnx_dir: str | Path, file_name: str = MODEL_ONNX, **kwargs):
    """optimum's ORTModelForCausalLM for a bdlora ONNX folder (see ``BdloraORTModelForCausalLM``)."""
    return ort_model_class().from_pretrained(str(onnx_dir), file_name=file_name, use_cache=True,
                                             use_io_binding=False, **kwargs)


def ort_model_class():
    try:
        from optimum.onnxruntime import ORTModelForCausalLM
    except ImportError:
        raise UsageError(f"loading an ONNX folder with optimum {EXTRA_HINT}") from None

    class BdloraORTModelForCausalLM(ORTModelForCausalLM):
        """optimum's ORT decoder, told the true cache shape of bdlora model types.

        optimum sizes the empty first-step cache from ``num_attention_heads`` for model types it does not know (it
        lists mistral, llama, qwen2, ... explicitly), which breaks GQA (kv_heads < heads). This subclass only
        replaces those two numbers with the config's ``num_key_value_heads`` and head dimension."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            shape = DecoderShape.of(self.config)
            self.num_key_value_heads, self.embed_size_per_head = shape.kv_heads, shape.head_dim

    return BdloraORTModelForCausalLM
