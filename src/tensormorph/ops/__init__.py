"""Pure functions over checkpoints: summaries, module trees, statistics."""
