"""The upgrade report: one row per seam, one per variant tried; report.md, report.json and the
outcome the command's exit status gives."""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from forge.upgrade.guide import SeamGuide
from forge.upgrade.variants import VariantResult


class Outcome(enum.StrEnum):
    """What the check concluded; the command's exit status says it to a scheduler."""

    PROPOSED = "proposed"                # an experimental cell, its trial proofs passed or skipped
    ALREADY_A_CELL = "already-a-cell"    # this very release is a cell: nothing to do
    NOT_PROPOSABLE = "not-proposable"    # a seam without exactly one working variant, or a
                                         # series that is another release's cell
    PROOF_FAILED = "proof-failed"        # proposed, but its trial build or L0/L1 failed

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self]


# 1 and 2 stay what every forge command means by them (bad input, usage).
EXIT_STATUS = {Outcome.PROPOSED: 0, Outcome.ALREADY_A_CELL: 0, Outcome.NOT_PROPOSABLE: 3,
               Outcome.PROOF_FAILED: 4}


# --- the report -----------------------------------------------------------------------------


@dataclass
class SeamRow:
    seam: str
    chosen: str | None
    result: str
    variants: list[str]
    note: str = ""


@dataclass
class UpgradeReport:
    engine: str
    version: str
    nearest_cell: str
    nearest_version: str
    index_url: str
    sources: str
    artifacts: list[dict[str, str]]
    python: str | None
    torch: str | None
    seams: list[SeamRow]
    variants: list[VariantResult]
    cell_proposed: bool
    cell_name: str
    verdict: str
    matrix_entry: str = ""
    cell_written: bool = False
    build: str = "skipped"
    l0_l1: str = "skipped"
    import_mode: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    outcome: Outcome = Outcome.NOT_PROPOSABLE
    guides: list[SeamGuide] = field(default_factory=list)

    def to_json(self) -> str:
        document = asdict(self)
        for variant in document["variants"]:
            variant.pop("diff")
        document["outcome"] = str(self.outcome)
        document["exit_status"] = self.outcome.exit_status
        document["summary"] = self.summary()
        return json.dumps(document, indent=2) + "\n"

    def summary(self) -> str:
        """A short markdown text for a person (an issue's body): the outcome, the verdict, each
        seam without a working variant and where its code went."""
        lines = [f"**{self.engine} {self.version}: {self.outcome}** (nearest cell "
                 f"{self.nearest_cell}, {self.engine} {self.nearest_version})", "",
                 f"- verdict: {self.verdict}"]
        if self.cell_proposed:
            lines += [f"- build: {self.build}", f"- L0/L1: {self.l0_l1}"]
        failing = [row for row in self.seams if row.chosen is None]
        if failing:
            lines += ["", "| seam | result |", "|---|---|"]
            lines += [f"| {row.seam} | {row.result}"
                      + (f": {_cell_text(row.note)}" if row.note else "") + " |"
                      for row in failing]
        lines += self._guide_lines()
        return "\n".join(lines) + "\n"

    def _guide_lines(self) -> list[str]:
        if not self.guides:
            return []
        lines = ["", "## Where the failing seams' code went", ""]
        for guide in self.guides:
            lines += guide.to_markdown(self.engine, self.nearest_version, self.version)
        return lines

    def to_markdown(self) -> str:
        lines = [
            f"# Upgrade check: {self.engine} {self.version}",
            "",
            f"- nearest cell: {self.nearest_cell} ({self.engine} {self.nearest_version})",
            f"- index: {self.index_url}",
            "- artifacts: " + ", ".join(f"{a['role']} {a['filename']} (sha256 {a['sha256']})"
                                        for a in self.artifacts),
            f"- transforms tried on: {self.sources}",
            f"- Requires-Python: {self.python or 'not declared'}; torch: "
            f"{self.torch or 'not pinned'}",
            f"- import check: {self.import_mode}",
            f"- verdict: {self.verdict}",
            f"- outcome: {self.outcome} (exit status {self.outcome.exit_status})",
            "",
            "## Seams",
            "",
            "| seam | chosen | result | variants tried |",
            "|---|---|---|---|",
        ]
        for row in self.seams:
            note = f" ({row.note})" if row.note else ""
            lines.append(f"| {row.seam} | {row.chosen or '-'} | {row.result}{note} | "
                         f"{', '.join(row.variants) or '-'} |")
        lines += ["", "## Variants", "",
                  "| variant | seams | registered range | result | hits | compile | "
                  "kvcached use | same change | detail |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for v in self.variants:
            lines.append(
                f"| {v.id} | {', '.join(v.seams)} | {v.registered_range} | {v.result} | "
                f"{v.hits}/{v.expected} | {v.compile_check} | {v.import_check} | "
                f"{v.same_change} | {_cell_text(v.detail) or '-'} |")
        lines += self._guide_lines()
        lines += ["", "## Cell", ""]
        if self.cell_proposed:
            where = "appended to matrix.toml" if self.cell_written else \
                "proposed in matrix-entry.toml (not in matrix.toml; --write-cell appends it)"
            lines.append(f"experimental cell {self.cell_name}: {where}; unreviewed diffs in "
                         "unreviewed/")
        else:
            lines.append(f"no cell proposed: {self.verdict}")
        lines += [f"- build: {self.build}", f"- L0/L1: {self.l0_l1}", "", "## Timings", ""]
        lines += [f"- {name}: {seconds:.2f} s" for name, seconds in self.timings.items()]
        return "\n".join(lines) + "\n"


def _cell_text(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_report(report: UpgradeReport, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(report.to_json(), encoding="utf-8")
    (out_dir / "report.md").write_text(report.to_markdown(), encoding="utf-8")


def default_out_dir(engine: str, version: str) -> Path:
    return Path("reports") / "upgrade" / f"{engine}-{version}"
