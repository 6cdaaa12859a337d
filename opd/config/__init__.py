"""The run's config: its sections, the whole, YAML in and out, run directories."""
