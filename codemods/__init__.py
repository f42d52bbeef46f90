"""libcst codemods that rewrite upstream engine sources, and the registry of every transform."""
