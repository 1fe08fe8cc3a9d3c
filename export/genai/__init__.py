"""Export for onnxruntime-genai, the LLM runtime users deploy with (``bdlora export genai``):

- ``graph``: the decoder graph in the runtime's native layout (GroupQueryAttention with a shareable KV buffer, fused
  RMSNorm + residual, rotary inside attention), every projection in its deployed dense / low-rank form;
- ``config``: ``genai_config.json``;
- ``quantize``: int8 / int4 weights as MatMulNBits;
- ``validate``: parity with PyTorch, ``og.Generator`` greedy tokens, the runtime's tokenizer, quantised quality;
- ``folder``: the command (a model folder in, a validated genai folder out).
"""

from bdlora.export.genai.folder import export_genai_folder

__all__ = ["export_genai_folder"]
