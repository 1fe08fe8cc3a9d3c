"""bdlora.serve: the inference server over an exported ONNX student.

Installed as ``bdlora.serve`` through setuptools ``package-dir`` (see pyproject.toml). The server lands with the
serve issue; until then this package only reserves the namespaced import path.
"""
