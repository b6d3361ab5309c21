"""splitserve's own compiled kernels (built on the worker's machine on first use)."""
