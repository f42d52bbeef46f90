"""forge: builds patched engine wheels from matrix.toml cells.

The transforms themselves and their declarations live in ``codemods`` (``codemods/catalog.py``);
forge selects, checks and runs them: ``forge.registry`` (the registry, ``default_registry()``,
seam checks), ``forge.patches`` (diff files), ``forge.fingerprint`` (patch-set fingerprint),
``forge.transforms`` (applying a set to a workspace), ``forge.build`` (a whole cell).
"""

TOOLKIT_VERSION = "0.1.0"
