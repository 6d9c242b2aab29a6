"""Model runtime: MiniLM in plain torch and the model-kind handlers.

Artifact URIs and their hashes live in the kernel (``sluice.artifacts``): the control plane
records hashes without importing this package.
"""
