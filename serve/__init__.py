"""bdlora.serve: an OpenAI-compatible inference server over an exported ONNX student (``bdlora serve``).

``engine`` holds the onnxruntime session and the continuous-batching worker thread; ``app`` the FastAPI routes,
metrics and error handling. Installed as ``bdlora.serve`` through setuptools ``package-dir`` (see pyproject.toml).
"""
