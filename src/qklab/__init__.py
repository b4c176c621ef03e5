"""qklab: control the query-key part of transformer attention."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``qklab.attach``, ``qklab.QK``, ``qklab.load_run`` and ``qklab.hf``, imported on first use (transformers
    stays optional, ``qklab --version`` imports no torch)."""
    if name == "QK":
        from qklab.model.qk import QK

        return QK
    if name == "load_run":
        from qklab.rundir.load import load_run

        return load_run
    if name == "attach":
        from qklab.hf.attach import attach

        return attach
    if name == "hf":
        import importlib

        return importlib.import_module("qklab.hf")
    raise AttributeError(f"module 'qklab' has no attribute '{name}'")
