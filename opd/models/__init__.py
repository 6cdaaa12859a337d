"""The models: the transformer, its configs, tokenizers, checkpoints, devices."""
