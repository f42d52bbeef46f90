# ruff: noqa: E501  (the expected sources hold the codemod's import line as written)
"""codemods/sglang/startup_memory: whole before/after sources of SGLang 0.5.23's two start-up
free-memory reads, the capacity seam's rewrite of the same method, idempotency, and what is
left alone."""

from __future__ import annotations

import textwrap

import pytest
from libcst.codemod import CodemodContext, TransformSuccess, transform_module

from codemods.base import BuildContext, HitCountingCodemod
from codemods.catalog import CODEMODS
from codemods.sglang._method import MethodScopedCodemod
from codemods.sglang.capacity import KVBudgetCapacity
from codemods.sglang.startup_memory import ElasticKVProfileMemory, ElasticPreModelLoadMemory
from codemods.sglang.startup_memory_at_init import ElasticPreModelLoadMemoryAtInit

BUILD = BuildContext(
    cell="sglang-0.5.23", engine="sglang", package="sglang", upstream_version="0.5.23",
    built_version="0.5.23+kvcached.1", base_artifact="sglang.whl", base_sha256="00" * 32,
    transform_ids=(), fingerprint="11" * 32, toolkit_version="0.1.0",
)


def run(codemod: type[HitCountingCodemod], source: str) -> tuple[int, int, str]:
    command = codemod(CodemodContext(filename="x.py"), BUILD)
    result = transform_module(command, source)
    assert isinstance(result, TransformSuccess)
    return command.hits, command.already_applied, result.code


# sglang/srt/distributed/bootstrap.py (0.5.23), the function and a neighbour that also reduces
# free memory across ranks but is no start-up check.
BOOTSTRAP = textwrap.dedent('''\
    def measure_pre_model_load_memory(*, device: str, is_draft_worker: bool) -> float:
        """Measure available memory for KV-cache sizing before this runner loads."""
        before_avail_memory = get_available_gpu_memory(device, get_device().gpu_id)

        pre_model_load_memory = get_available_gpu_memory(
            device,
            get_device().gpu_id,
            distributed=get_world_group().world_size > 1 and not is_draft_worker,
            cpu_group=get_world_group().cpu_group,
        )
        local_gpu_memory = get_available_gpu_memory(device, get_device().gpu_id)
        if get_parallel().tp_size > 1 and not is_draft_worker:
            _check_tp_memory_balance(
                pre_model_load_memory=pre_model_load_memory,
                local_gpu_memory=local_gpu_memory,
            )
        return pre_model_load_memory


    def other_measure(device, group):
        return get_available_gpu_memory(device, 0, distributed=True, cpu_group=group)
    ''')

BOOTSTRAP_PATCHED = textwrap.dedent('''\
    def measure_pre_model_load_memory(*, device: str, is_draft_worker: bool) -> float:
        """Measure available memory for KV-cache sizing before this runner loads."""
        from kvcached_core.integration.sglang.startup import elastic_free_memory_gb as _kvcached_elastic_free_memory_gb
        before_avail_memory = get_available_gpu_memory(device, get_device().gpu_id)

        pre_model_load_memory = _kvcached_elastic_free_memory_gb(
            get_available_gpu_memory,
            device,
            get_device().gpu_id,
            distributed=get_world_group().world_size > 1 and not is_draft_worker,
            cpu_group=get_world_group().cpu_group,
            startup_window=None if is_draft_worker else "begin",
        )
        local_gpu_memory = get_available_gpu_memory(device, get_device().gpu_id)
        if get_parallel().tp_size > 1 and not is_draft_worker:
            _check_tp_memory_balance(
                pre_model_load_memory=pre_model_load_memory,
                local_gpu_memory=local_gpu_memory,
            )
        return pre_model_load_memory


    def other_measure(device, group):
        return get_available_gpu_memory(device, 0, distributed=True, cpu_group=group)
    ''')

# sglang/srt/mem_cache/kv_cache_configurator.py (0.5.23), shortened around the two reads of
# free memory in the class: the log line in configure and the budget's profile.
CONFIGURATOR = textwrap.dedent('''\
    class KVCacheConfigurator:
        def configure(self, *, pre_model_load_memory: int) -> KVCacheConfigResult:
            logger.info(
                f"Memory pool end. "
                f"avail mem={get_available_gpu_memory(self.device, self.gpu_id):.2f} GB"
            )

        def _profile_available_bytes(self, pre_model_load_memory: int) -> int:
            # KV pool budget = currently-free GPU memory minus the non-static runtime
            # slack (pre_model_load_memory * (1 - mem_fraction_static)).
            gc.collect()
            available_gpu_memory = get_available_gpu_memory(
                self.device,
                self.gpu_id,
                distributed=get_parallel().launch_world_size > 1,
                cpu_group=get_parallel().world_group.cpu_group,
            )

            slack_gb = pre_model_load_memory * (1 - get_schedule().mem_fraction_static)
            rest_memory = available_gpu_memory - slack_gb
            if rest_memory <= 0:
                raise ValueError("Loaded weights leave no GPU memory for the KV cache")

            return int(rest_memory * (1 << 30))  # return in bytes
    ''')

CONFIGURATOR_PATCHED = textwrap.dedent('''\
    class KVCacheConfigurator:
        def configure(self, *, pre_model_load_memory: int) -> KVCacheConfigResult:
            logger.info(
                f"Memory pool end. "
                f"avail mem={get_available_gpu_memory(self.device, self.gpu_id):.2f} GB"
            )

        def _profile_available_bytes(self, pre_model_load_memory: int) -> int:
            from kvcached_core.integration.sglang.startup import elastic_free_memory_gb as _kvcached_elastic_free_memory_gb
            # KV pool budget = currently-free GPU memory minus the non-static runtime
            # slack (pre_model_load_memory * (1 - mem_fraction_static)).
            gc.collect()
            available_gpu_memory = _kvcached_elastic_free_memory_gb(
                get_available_gpu_memory,
                self.device,
                self.gpu_id,
                distributed=get_parallel().launch_world_size > 1,
                cpu_group=get_parallel().world_group.cpu_group,
                startup_window="end",
            )

            slack_gb = pre_model_load_memory * (1 - get_schedule().mem_fraction_static)
            rest_memory = available_gpu_memory - slack_gb
            if rest_memory <= 0:
                raise ValueError("Loaded weights leave no GPU memory for the KV cache")

            return int(rest_memory * (1 << 30))  # return in bytes
    ''')


def test_pre_model_load_measure_goes_through_the_adapter() -> None:
    assert run(ElasticPreModelLoadMemory, BOOTSTRAP) == (1, 0, BOOTSTRAP_PATCHED)


def test_kv_profile_measure_goes_through_the_adapter_and_the_log_read_stays() -> None:
    assert run(ElasticKVProfileMemory, CONFIGURATOR) == (1, 0, CONFIGURATOR_PATCHED)


@pytest.mark.parametrize(("codemod", "patched"), [
    (ElasticPreModelLoadMemory, BOOTSTRAP_PATCHED),
    (ElasticKVProfileMemory, CONFIGURATOR_PATCHED),
])
def test_a_rewritten_tree_is_recognised_and_left_unchanged(
        codemod: type[HitCountingCodemod], patched: str) -> None:
    assert run(codemod, patched) == (0, 1, patched)


def test_the_capacity_seam_and_this_one_compose_on_the_same_method() -> None:
    # Catalogue order: sglang-kv-budget, then sglang-kv-profile-free-memory.
    hits, _, budgeted = run(KVBudgetCapacity, CONFIGURATOR)
    assert hits == 1
    hits, _, both = run(ElasticKVProfileMemory, budgeted)
    assert hits == 1
    import_line = ("        from kvcached_core.integration.sglang.startup import "
                   "elastic_free_memory_gb as _kvcached_elastic_free_memory_gb\n")
    budget_import = ("        from kvcached_core.integration.sglang.startup import "
                     "kv_budget_bytes as _kvcached_kv_budget_bytes\n")
    stock_return = "        return int(rest_memory * (1 << 30))  # return in bytes"
    assert import_line in CONFIGURATOR_PATCHED and stock_return in CONFIGURATOR_PATCHED
    assert both == CONFIGURATOR_PATCHED.replace(
        import_line, import_line + budget_import,
    ).replace(stock_return,
              "        return _kvcached_kv_budget_bytes(int(rest_memory * (1 << 30)))  # return in bytes")


def changed(source: str, old: str, new: str) -> str:
    assert old in source, old
    return source.replace(old, new)


@pytest.mark.parametrize(("codemod", "source"), [
    # A local (not rank-reduced) read is no start-up figure of SGLang's: nothing to rewrite.
    (ElasticPreModelLoadMemory, changed(
        BOOTSTRAP, "        distributed=get_world_group().world_size > 1 and not is_draft_worker,\n",
        "")),
    # The function renamed or moved: the build must fail (no hit), not patch something else.
    (ElasticPreModelLoadMemory, changed(BOOTSTRAP, "def measure_pre_model_load_memory",
                                        "def measure_memory_baseline")),
    (ElasticKVProfileMemory, changed(CONFIGURATOR, "class KVCacheConfigurator",
                                     "class PoolConfigurator")),
    (ElasticKVProfileMemory, changed(CONFIGURATOR, "= get_available_gpu_memory(\n",
                                     "= current_platform.free_memory(\n")),
])
def test_a_moved_or_changed_anchor_matches_nothing(codemod: type[HitCountingCodemod],
                                                    source: str) -> None:
    hits, already, code = run(codemod, source)
    assert (hits, already, code) == (0, 0, source)


def test_both_start_up_reads_are_registered_for_0_5_23_with_their_targets() -> None:
    declared = {d.id: d for d in CODEMODS}
    pre_load = declared["sglang-startup-free-memory"]
    profile = declared["sglang-kv-profile-free-memory"]
    assert (pre_load.seam, pre_load.codemod, pre_load.targets) == (
        "startup-free-memory", ElasticPreModelLoadMemory,
        ("{package}/srt/distributed/bootstrap.py",))
    assert (profile.seam, profile.codemod, profile.targets) == (
        "kv-profile-free-memory", ElasticKVProfileMemory,
        ("{package}/srt/mem_cache/kv_cache_configurator.py",))
    ids = [d.id for d in CODEMODS]
    assert ids.index("sglang-kv-budget") < ids.index("sglang-kv-profile-free-memory")


def test_a_call_on_one_line_gets_the_window_keyword_last_on_that_line() -> None:
    source = CONFIGURATOR.replace(
        textwrap.indent(textwrap.dedent('''\
            available_gpu_memory = get_available_gpu_memory(
                self.device,
                self.gpu_id,
                distributed=get_parallel().launch_world_size > 1,
                cpu_group=get_parallel().world_group.cpu_group,
            )
        '''), "        "),
        "        available_gpu_memory = get_available_gpu_memory(self.device, self.gpu_id, "
        "distributed=True)\n")
    assert source != CONFIGURATOR
    hits, _, code = run(ElasticKVProfileMemory, source)
    assert hits == 1
    assert ("        available_gpu_memory = _kvcached_elastic_free_memory_gb("
            "get_available_gpu_memory, self.device, self.gpu_id, distributed=True, "
            'startup_window="end")\n') in code


@pytest.mark.parametrize(("codemod", "window"), [
    # A draft worker reuses the target's pool config: no KV-profile read would close its window.
    (ElasticPreModelLoadMemory, 'None if is_draft_worker else "begin"'),
    (ElasticPreModelLoadMemoryAtInit, 'None if is_draft_worker else "begin"'),
    (ElasticKVProfileMemory, '"end"'),
])
def test_the_pre_load_reads_open_the_window_and_the_kv_profile_read_closes_it(
        codemod: type[MethodScopedCodemod], window: str) -> None:
    read = 'return get_available_gpu_memory("cuda", 0, distributed=True)\n'
    if codemod.CLASS:
        source = f"class {codemod.CLASS}:\n    def {codemod.METHOD}(self):\n        {read}"
    else:
        source = f"def {codemod.METHOD}(*, is_draft_worker):\n    {read}"
    hits, _, code = run(codemod, source)
    assert hits == 1
    assert f"distributed=True, startup_window={window})" in code


@pytest.mark.parametrize("codemod", [ElasticPreModelLoadMemory, ElasticPreModelLoadMemoryAtInit])
def test_a_pre_load_read_without_the_draft_flag_is_not_rewritten(
        codemod: type[MethodScopedCodemod]) -> None:
    # Without is_draft_worker the rewrite cannot keep a draft worker out of the window: the
    # build must fail on the missing hit rather than leave a window no read closes.
    source = (f"def {codemod.METHOD}(*, device):\n"
              "    return get_available_gpu_memory(device, 0, distributed=True)\n")
    assert run(codemod, source) == (0, 0, source)
