"""One module per patch: when it applies (``decide``), how it is applied, and the post-import hooks that do it."""
