"""libcst codemods that rewrite upstream engine sources, and their declarations (catalog.py).

This package holds only transforms and data about them; the toolkit that selects, checks and
runs them is ``forge``, which imports this package and is never imported by it.
"""
