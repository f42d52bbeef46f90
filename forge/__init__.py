"""forge: builds patched engine wheels from matrix.toml cells."""

TOOLKIT_VERSION = "0.1.0"
