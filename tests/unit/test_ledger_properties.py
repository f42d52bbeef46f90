"""Random traces against BlockLedger on the real native allocator (host backend).

Properties: no block is handed out twice; no page leaks (after freeing everything and trimming
the allocator maps nothing but the null block's page); available_size equals what alloc
accepts; PoolExhausted leaves the ledger unchanged; StateConsistencyError makes the pool refuse.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvcached_core import _C
from kvcached_core.errors import (
    MapQuarantinedError,
    PoolExhausted,
    StateConsistencyError,
)
from kvcached_core.ledger import BlockLedger

KIB = 1024
PAGE = 64 * KIB
NUM_PAGES = 12


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.live: set[int] = set()
        self.failed = False
        self.manager: BlockLedger
        self.pages: Any = None

    @initialize(
        block_kib=st.sampled_from([8, 16, 32, 64]),
        null_block=st.booleans(),
        defer=st.booleans(),
        max_reserved=st.integers(0, 3),
        contiguous=st.booleans(),
    )
    def build(
        self, block_kib: int, null_block: bool, defer: bool, max_reserved: int, contiguous: bool
    ) -> None:
        self.backend = _C.HostBackend(0)
        self.ftensors = _C.FTensorAllocator(self.backend, PAGE, contiguous)
        self.ftensors.create_kv_tensors(NUM_PAGES * PAGE, 2, 2)
        # No refill thread: the counters then change only under this thread, so available_size
        # must equal exactly what alloc accepts.
        self.pages = _C.PageAllocator(self.ftensors, 0, max_reserved, False)
        self.manager = BlockLedger(
            self.pages,
            block_kib * KIB,
            PAGE,
            set_aside_null_block=null_block,
            defer_physical_release=defer,
        )
        self.markers: list[int] = []

    def ledger_state(self) -> tuple[Any, ...]:
        manager = self.manager
        return (
            manager.page_occupancy(),
            manager.num_used_blocks,
            manager.num_set_aside_blocks,
            manager.available_size(),
            self.pages.num_in_use,
            tuple(self.ftensors.mapped_page_ids()),
        )

    def check_refusing(self) -> None:
        with pytest.raises(StateConsistencyError):
            self.manager.alloc(1)
        self.failed = True

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: not self.failed)
    @rule(extra=st.integers(-3, 3), fraction=st.floats(0, 1))
    def alloc(self, extra: int, fraction: float) -> None:
        available = self.manager.available_size()
        n = max(0, int(available * fraction) + extra)
        before = self.ledger_state()
        if n > available:
            with pytest.raises(PoolExhausted):
                self.manager.alloc(n)
            assert self.ledger_state() == before
            return
        blocks = self.manager.alloc(n)
        assert len(blocks) == n == len(set(blocks))
        assert not self.live & set(blocks), "a block was handed out twice"
        assert self.manager.null_block_id not in blocks
        self.live |= set(blocks)

    @precondition(lambda self: not self.failed and bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        chosen = data.draw(
            st.lists(st.sampled_from(sorted(self.live)), unique=True, min_size=1), label="free"
        )
        self.manager.free(chosen)
        self.live -= set(chosen)

    @precondition(lambda self: not self.failed)
    @rule(data=st.data())
    def bad_free(self, data: st.DataObject) -> None:
        total = NUM_PAGES * self.manager.blocks_per_page
        not_live = [b for b in range(-2, total + 2) if b not in self.live]
        bad = data.draw(st.sampled_from(not_live), label="bad id")
        good = sorted(self.live)[:2]
        before = self.ledger_state()
        with pytest.raises(StateConsistencyError, match=f"block {bad}"):
            self.manager.free([*good, bad])
        assert self.ledger_state() == before
        self.check_refusing()

    @precondition(lambda self: not self.failed)
    @rule(blocks=st.integers(0, NUM_PAGES * 8))
    def resize(self, blocks: int) -> None:
        self.manager.resize(blocks)
        bpp = self.manager.blocks_per_page
        assert self.manager.num_blocks == min(blocks // bpp, NUM_PAGES) * bpp

    @precondition(lambda self: not self.failed)
    @rule(n=st.integers(0, 12))
    def try_to_set_aside(self, n: int) -> None:
        available = self.manager.available_size()
        set_aside = self.manager.num_set_aside_blocks
        ok = self.manager.try_to_set_aside(n)
        assert ok == (n <= available - (set_aside - (self.manager.null_block_id is not None)))
        assert self.manager.available_size() == available

    @precondition(lambda self: not self.failed)
    @rule()
    def free_set_aside(self) -> None:
        self.manager.free_set_aside()
        assert self.manager.num_set_aside_blocks == (self.manager.null_block_id is not None)

    @precondition(lambda self: not self.failed)
    @rule()
    def capture_marker(self) -> None:
        self.markers.append(self.manager.capture_release_marker())

    @precondition(lambda self: not self.failed and bool(self.markers))
    @rule(data=st.data())
    def release_through(self, data: st.DataObject) -> None:
        marker = data.draw(st.sampled_from(self.markers), label="marker")
        self.manager.release_retired_through(marker)

    @precondition(lambda self: not self.failed)
    @rule(op=st.sampled_from(["create", "map"]), oom=st.booleans(), nth=st.integers(1, 3))
    def alloc_with_map_fault(self, op: str, oom: bool, nth: int) -> None:
        available = self.manager.available_size()
        before = self.ledger_state()
        self.backend.inject_failure(op, nth, oom)
        try:
            blocks = self.manager.alloc(available)
        except PoolExhausted:
            assert self.ledger_state() == before
        except MapQuarantinedError:
            # Rollback was uncertain: the allocator set pages aside; the ledger is unchanged.
            assert self.ledger_state()[:3] == before[:3]
        else:
            assert not self.live & set(blocks)
            self.live |= set(blocks)
        finally:
            self.backend.clear_injected_failures()

    @precondition(lambda self: not self.failed and bool(self.live))
    @rule()
    def free_with_unmap_fault(self) -> None:
        self.backend.inject_failure("unmap", 1, False)
        try:
            self.manager.free(sorted(self.live))
        except StateConsistencyError:
            self.check_refusing()
            return
        finally:
            self.backend.clear_injected_failures()
        self.live.clear()

    @precondition(lambda self: self.failed)
    @rule(n=st.integers(0, 4))
    def stays_refusing(self, n: int) -> None:
        with pytest.raises(StateConsistencyError, match="refuses work"):
            self.manager.alloc(n)
        with pytest.raises(StateConsistencyError, match="refuses work"):
            self.manager.free(sorted(self.live)[:1] or [0])
        with pytest.raises(StateConsistencyError, match="refuses work"):
            self.manager.try_to_set_aside(1)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def counters_agree(self) -> None:
        if self.pages is None or self.failed:
            return
        manager = self.manager
        assert manager.num_used_blocks == len(self.live)
        assert self.pages.num_in_use == len(manager.page_occupancy())
        bpp = manager.blocks_per_page
        held = {block // bpp for block in self.live}
        assert held <= set(manager.page_occupancy())

    def teardown(self) -> None:
        if self.pages is None:
            return
        try:
            if not self.failed:
                manager = self.manager
                manager.free(sorted(self.live))
                manager.free_set_aside()
                manager.release_retired_through(manager.capture_release_marker())
                manager.resize(NUM_PAGES * manager.blocks_per_page)
                manager.trim()
                expected = [] if manager.null_block_id is None else [0]
                assert self.ftensors.mapped_page_ids() == expected, "a page leaked"
                assert self.pages.num_in_use == len(expected)
        finally:
            self.pages.stop()


LedgerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLedger = LedgerMachine.TestCase
