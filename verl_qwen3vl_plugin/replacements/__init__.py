"""Replacement forwards for the model classes the plugin patches, one module per model family."""
