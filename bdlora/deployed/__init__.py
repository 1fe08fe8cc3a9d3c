"""bdlora.deployed: the compressed student as its own Hugging Face architecture, a core concept of the toolkit.

- ``modeling_bdlora``: the config/model classes (``bdlora_mistral``, ``bdlora_llama``, ``bdlora_qwen2``,
  ``bdlora_gemma3_text``) and
  ``LowRankLinear``; self-contained (torch + transformers only), copied into every model folder so
  ``trust_remote_code=True`` works where bdlora is not installed;
- ``folder``: writing a compressed model folder (``save_model_folder``) and registering the architectures with
  transformers' Auto classes (``register``: ``AutoConfig.register`` / ``AutoModelForCausalLM.register``, run when
  this package is imported, as every module that builds or loads a compressed model does).

``compress`` and ``compress --one-shot`` write these folders; the exporters (``bdlora.export``: hf, onnx, genai) and
the bench read them. Nothing here imports ``bdlora.export`` or ``bdlora.serve``.
"""

from bdlora.deployed.folder import register

register()  # AutoConfig / AutoModelForCausalLM know the bdlora_* model types from here on
