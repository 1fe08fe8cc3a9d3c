"""bdlora.serve: an OpenAI-compatible inference server over an exported student (``bdlora serve``), layered
like the servers users know (vLLM's OpenAI entrypoint):

- ``protocol``: pydantic request and response models (requests check and convert themselves to sampling
  parameters: ``to_sampling_params``), the OpenAI error body;
- ``sampling``: ``SamplingParams`` and the pure ``sample(logits, params, rng)``;
- ``handlers``: the completion and chat-completion logic (``CompletionServing``, ``ChatServing``);
- ``engine``: the onnxruntime session and the continuous-batching worker thread (``--runtime ort``);
- ``genai_engine``: the same engine over onnxruntime-genai (``--runtime genai``): requests admitted together decode
  as one batched generator (a cohort);
- ``engine_process``: an engine in a child process behind the same interface (the server runs the genai engine
  there: onnxruntime-genai keeps the GIL while the model runs);
- ``sequence``: one request inside a batch: detokenising, stop strings, log-probabilities;
- ``metrics``: Prometheus metrics;
- ``config``: ``ServeConfig``;
- ``app``: the FastAPI app wiring routes to handlers (bodies validated off the event loop), and the process
  lifecycle;
- ``transport``: between the socket and the routes: the listening socket, head and body deadlines, the body limit,
  the API key, the request counter;
- ``loadtest``: ``bdlora loadtest``, a closed-loop load generator for any OpenAI-compatible endpoint.

Serving needs numpy, onnxruntime, tokenizers and the web stack, never torch. Installed as ``bdlora.serve`` through
setuptools ``package-dir`` (see pyproject.toml).
"""
