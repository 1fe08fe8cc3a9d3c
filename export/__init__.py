"""bdlora.export: deployment formats of a compressed student (Hugging Face architecture, ONNX).

Installed as ``bdlora.export`` through setuptools ``package-dir`` (see pyproject.toml). The exporters land with the
compression and ONNX issues; until then this package only reserves the namespaced import path.
"""
