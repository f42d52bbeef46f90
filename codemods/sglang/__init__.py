"""Codemods of the SGLang cells, one module per seam (declared in codemods/catalog.py)."""
