"""In-tree model-family plugins. Each is registered through the ``ferrule`` entry-point group,
exactly like an out-of-tree plugin package."""
