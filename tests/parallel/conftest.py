"""Tensor and data parallelism on CPU: ranks are processes joined over gloo on loopback."""
