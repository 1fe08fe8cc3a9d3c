"""bdlora.deployed: the compressed student as its own Hugging Face architecture, a core concept of the toolkit.

- ``modeling_bdlora``: the config/model classes (``bdlora_mistral``, ``bdlora_llama``, ``bdlora_qwen2``) and
  ``LowRankLinear``; self-contained (torch + transformers only), copied into every model folder so
  ``trust_remote_code=True`` works where bdlora is not installed;
- ``folder``: writing a compressed model folder (``save_model_folder``) and registering the architectures with
  transformers' Auto classes (``register``, run by the hook in ``bdlora._registration``).

``compress`` and ``compress --one-shot`` write these folders; the exporters (``bdlora.export``: hf, onnx, genai) and
the bench read them. Nothing here imports ``bdlora.export`` or ``bdlora.serve``.
"""

# transformers first: importing it runs bdlora's registration hook (see bdlora._registration), which imports
# ``modeling_bdlora``; doing it here, before any submodule, means that module is never half-initialised then.
import transformers  # noqa: E402, F401
