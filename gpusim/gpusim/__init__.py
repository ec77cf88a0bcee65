"""gpusim: a GPU-less test double for nvidia-smi and an SGLang-compatible server."""

SGLANG_VERSION = "0.5.23"
__version__ = "0.1.0"
