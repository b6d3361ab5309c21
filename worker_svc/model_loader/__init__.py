"""Loading a rank's model (vLLM's model_loader): what LoadModel carries, the model shard built, checkpoints read, pooling config."""
