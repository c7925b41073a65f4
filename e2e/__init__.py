"""kvflow end-to-end tests: a real local Kubernetes control plane (`e2e.k8s`) and the
tests that run against it."""

__all__: list[str] = []
