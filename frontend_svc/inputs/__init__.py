"""Input processing (vLLM's InputProcessor): tokenizer and chat template, images, the model's files and generation config."""
