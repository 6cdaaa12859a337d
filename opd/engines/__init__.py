"""Rollout engines: the interface and its kinds, sampling, the built-in engine, transformers', vLLM."""
