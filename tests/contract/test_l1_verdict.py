"""The L1 verdict (no engine needed): a suite that shrinks, or a test that passes only on the
stock tree, fails the cell; failures shared by both trees count only against the floor."""

from __future__ import annotations

from tests.contract.vllm_contract import l1_verdict

STOCK = {"t::a": "passed", "t::b": "passed", "t::c": "skipped", "t::d": "ModelConfig invalid"}


def test_a_run_like_the_measured_one_passes() -> None:
    assert l1_verdict("vllm-x", STOCK, dict(STOCK), floor=2) == []


def test_a_suite_that_shrinks_fails_on_its_floor() -> None:
    # A test file lost (a dependency missing, a collection error): both trees pass less.
    shrunk = {"t::a": "passed", "t::d": "ModelConfig invalid"}
    (problem,) = l1_verdict("vllm-x", shrunk, dict(shrunk), floor=2)
    assert problem.startswith("vllm-x: 1 L1 tests passed on the patched tree, below the "
                              "recorded floor proof.l1_min_passed = 2")


def test_a_stock_pass_that_the_patched_tree_skips_or_fails_is_lost() -> None:
    patched = dict(STOCK, **{"t::b": "skipped"})
    problems = l1_verdict("vllm-x", STOCK, patched, floor=1)
    assert problems == ["vllm-x: pass on the stock tree only: {'t::b': 'skipped'}"]


def test_trees_that_collect_different_tests_fail() -> None:
    patched = {k: v for k, v in STOCK.items() if k != "t::c"}
    (problem,) = l1_verdict("vllm-x", STOCK, patched, floor=2)
    assert problem == "vllm-x: the trees collected different tests: ['t::c']"
