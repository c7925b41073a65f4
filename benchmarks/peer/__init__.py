"""Peers kvflow is measured against that the benchmark builds itself (cached)."""

from .llama_cpp import LLAMA_CPP_PYTHON_VERSION, ensure_llama_server, llama_server_argv

__all__ = ["LLAMA_CPP_PYTHON_VERSION", "ensure_llama_server", "llama_server_argv"]
