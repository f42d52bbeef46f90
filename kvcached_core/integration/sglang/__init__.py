"""SGLang adapter: what the rewritten SGLang modules call.

The build rewrites SGLang's defining modules so that the token and paged allocators and the
MHA and MLA pools gain elastic subclasses (the mixins here), the configurator sizes and guards
the pools, and the finish path bounds the prefix cache. Version knowledge stays in the
transforms (`codemods/sglang/`); this package uses only interfaces of the SGLang releases its
transforms target.
"""

from kvcached_core.integration.sglang.switch import ELASTIC, elastic_enabled, sglang_settings

__all__ = ["ELASTIC", "elastic_enabled", "sglang_settings"]
