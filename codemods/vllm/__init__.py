"""Codemods that wire vLLM to kvcached_core, one module per seam (declared in catalog.py)."""
