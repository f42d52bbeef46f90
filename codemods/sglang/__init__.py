"""Codemods of the SGLang cells, one module per seam (registered in codemods/registry.py)."""
