"""Upgrade check: what the registered transforms make of an upstream release the matrix lacks.

``python -m forge upgrade-check <engine> <version|latest>`` resolves the release's artifacts
from the index (sha256 from the index), fetches them into the cache, and tries, for every seam
the engine requires, every registered transform of that seam regardless of its version range,
each on the release's pristine sources. Every seam gets a row; a failing transform never stops
the report. When every required seam has exactly one working transform, the check proposes an
``experimental`` matrix entry (``<out>/matrix-entry.toml``) with the unreviewed diffs beside it
(``<out>/unreviewed/``); only ``--write-cell`` appends the entry to matrix.toml. The registry's
version ranges are never widened here, and unreviewed diffs never go to
``patches/<engine>/<series>/reviewed/``: widening a range and approving a diff stay a review.
For a seam without a working variant the report says why the nearest cell's variant failed and
where that variant's code went in the release (``guide``).

``python -m forge upgrade-scan`` lists the releases on the index that no cell covers.

One module per job, imported in this order (each imports only the ones before it):
``release`` (the release on the index, its sources), ``variants`` (one variant on the sources),
``guide`` (where a failing seam's code went), ``report`` (rows, report.md / report.json, the
outcome), ``trial`` (trial build, L0 and L1), ``check`` (the whole check), ``scan``.
"""

from forge.upgrade.check import run_upgrade_check
from forge.upgrade.report import Outcome, UpgradeReport
from forge.upgrade.scan import ScanLine, scan

__all__ = ["Outcome", "ScanLine", "UpgradeReport", "run_upgrade_check", "scan"]
