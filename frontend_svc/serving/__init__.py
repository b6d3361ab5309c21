"""What the public APIs share: the served models, pooling requests and classification outputs."""
