"""Data: corpora and mixtures (``corpora``; the builtin, ``prose`` and ``fortunes`` sets), their tokenised token
files (``tokens``) and training blocks (``blocks``), and the teacher's own text (``selfgen``, through the teacher's
onnxruntime-genai export in ``runtime_samples``)."""
