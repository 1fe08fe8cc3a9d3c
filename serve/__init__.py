"""bdlora.serve: an OpenAI-compatible inference server over an exported ONNX student (``bdlora serve``), layered
like the servers users know (vLLM's OpenAI entrypoint):

- ``protocol``: pydantic request and response models, the OpenAI error body;
- ``handlers``: the completion and chat-completion logic (``CompletionServing``, ``ChatServing``);
- ``engine``: the onnxruntime session and the continuous-batching worker thread;
- ``metrics``: Prometheus metrics;
- ``config``: ``ServeConfig``;
- ``app``: the FastAPI app wiring routes to handlers, and the process lifecycle;
- ``loadtest``: ``bdlora loadtest``, a closed-loop load generator for any OpenAI-compatible endpoint.

Serving needs numpy, onnxruntime, tokenizers and the web stack, never torch. Installed as ``bdlora.serve`` through
setuptools ``package-dir`` (see pyproject.toml).
"""
