"""Export for llama.cpp, Ollama and LM Studio (``bdlora export gguf``): a model folder -> a folder holding one GGUF
file, checked in llama.cpp itself, with ``export.json`` (settings, layout, types, checks) and an Ollama
``Modelfile``.

- ``layout``: the GGUF architecture and every layer's shape (a student of pruned blocks: llama.cpp's ``deci``), what
  cannot be expressed refused;
- ``vocab``: the tokenizer keys (the source GGUF's own, or as llama.cpp's converter derives them);
- ``writer``: the file, one tensor at a time (f16, q8_0, q4_0 by the gguf package);
- ``llamacpp``: llama.cpp's quantizer (q4_k_m) and its checks (tokenizer, logits, held-out perplexity), through
  llama-cpp-python (the ``[llamacpp]`` extra);
- ``folder``: the command.
"""

from bdlora.export.gguf.folder import export_gguf_folder

__all__ = ["export_gguf_folder"]
