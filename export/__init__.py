"""bdlora.export: deployment formats of a compressed student.

- ``modeling_bdlora``: the compressed student as its own Hugging Face architecture (self-contained: copied into
  every model folder for ``trust_remote_code``);
- ``hf``: saving a compressed model folder, ``bdlora export hf`` (a clean, shareable folder with a model card) and
  the registration with transformers' Auto classes;
- ``onnx``: ``bdlora export onnx`` (a validated ONNX decoder with KV cache and per-module metadata).

Installed as ``bdlora.export`` through setuptools ``package-dir`` (see pyproject.toml).
"""

# transformers first: importing it runs bdlora's registration hook (see bdlora._registration), which imports
# ``modeling_bdlora``; doing it here, before any submodule, means that module is never half-initialised then.
import transformers  # noqa: E402, F401
