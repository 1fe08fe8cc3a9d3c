"""bdlora.export: the exporters of a compressed student (the folder format itself is core: ``bdlora.deployed``).

- ``hf``: ``bdlora export hf`` (a clean, shareable folder with a generated model card, ``card``);
- ``onnx``: ``bdlora export onnx`` (a validated ONNX decoder with KV cache and per-module metadata);
- ``genai``: ``bdlora export genai`` (onnxruntime-genai's graph layout and ``genai_config.json``).

Installed as ``bdlora.export`` through setuptools ``package-dir`` (see pyproject.toml).
"""
