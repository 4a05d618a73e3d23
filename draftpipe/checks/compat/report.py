"""The compatibility report: findings as typed records, the verdict, and its markdown for a person."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("error", "warning", "info")


class CompatError(ValueError):
    """The checkpoint or verifier cannot be read at all (missing file, truncated header); names the file, also as
    ``field`` (the file's name, for the report's finding)."""

    def __init__(self, message: str, field: str = "files"):
        super().__init__(message)
        self.field = field


@dataclass
class Finding:
    """One result of the check: ``id`` (stable, e.g. ``shape.head_dim``), ``severity`` (error / warning / info),
    ``field`` (config key or tensor name), ``expected`` and ``found`` values, the ``fix``, and a sentence."""

    id: str
    severity: str
    field: str
    message: str
    expected: Any = None
    found: Any = None
    fix: str = ""


@dataclass
class Report:
    """All findings for one draft directory against one verifier."""

    draft: str
    verifier: str
    format: str | None = None
    effective: dict = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    live: dict | None = None

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def add(
        self,
        id: str,
        severity: str,
        field: str,
        message: str,
        *,
        expected: Any = None,
        found: Any = None,
        fix: str = "",
    ) -> None:
        """Record a :class:`Finding`; what was expected, what was found and the fix are named, never positional."""
        assert severity in SEVERITIES, severity
        self.findings.append(Finding(id, severity, field, message, expected, found, fix))

    def ids(self, severity: str | None = None) -> list[str]:
        return [f.id for f in self.findings if severity is None or f.severity == severity]

    def to_dict(self) -> dict:
        counts = {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}
        return {
            "draft": self.draft,
            "verifier": self.verifier,
            "format": self.format,
            "ok": self.ok,
            "counts": counts,
            "effective": self.effective,
            "findings": [asdict(f) for f in self.findings],
            "live": self.live,
        }


def render_markdown(rep: Report) -> str:
    """A person-readable report: verdict, effective config, findings table grouped by severity."""
    d = rep.to_dict()
    verdict = "PASS" if rep.ok else "FAIL"
    c = d["counts"]
    lines = [
        f"# {'DFlash' if 'dflash' in (rep.format or '') else 'EAGLE-3'} compatibility report: {verdict}",
        "",
        f"- draft: `{rep.draft}`",
        f"- verifier: `{rep.verifier}`",
        f"- format: {rep.format}",
        f"- findings: {c['error']} error(s), {c['warning']} warning(s), {c['info']} note(s)",
        "",
    ]
    if rep.effective:
        e = rep.effective
        lines += ["## Effective draft config (as vLLM builds it)", "", "| field | value |", "|---|---|"]
        for k in (
            "architecture",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "num_hidden_layers",
            "vocab_size",
            "draft_vocab_size",
            "target_hidden_size",
            "num_aux_hidden_states",
            "aux_layer_ids_top_level",
            "aux_layer_ids_eagle_config",
            "norm_before_fc",
            "fc_norm",
            "norm_output",
            "norm_before_residual",
            "max_position_embeddings",
            "verifier_hidden_size",
            "verifier_vocab_size",
            "verifier_num_layers",
        ):
            v = e.get(k)
            if k == "head_dim":
                v = f"{v} ({'explicit' if e.get('head_dim_explicit') else 'derived'})"
            lines.append(f"| {k} | {v} |")
        lines.append("")
    for sev, title in (("error", "Errors"), ("warning", "Warnings"), ("info", "Notes")):
        rows = [f for f in rep.findings if f.severity == sev]
        if not rows:
            continue
        lines += [f"## {title}", "", "| id | field | finding | expected | found | fix |", "|---|---|---|---|---|---|"]
        for f in rows:
            cells = [f.id, f"`{f.field}`", f.message, _cell(f.expected), _cell(f.found), f.fix]
            lines.append("| " + " | ".join(str(x).replace("|", "\\|") for x in cells) + " |")
        lines.append("")
    if rep.live:
        lv = rep.live
        lines += ["## Live check in vLLM", ""]
        if lv.get("skipped"):
            lines.append(f"Skipped: {lv['skipped']}")
        elif lv.get("error"):
            lines += ["vLLM failed; its whole error output:", "", "```", lv["error"], "```"]
        else:
            lines += [
                f"- greedy output identical to the verifier alone: {'yes' if lv.get('identical') else 'NO'}",
                f"- acceptance length: {lv.get('acceptance_length', 0):.3f}",
                f"- per-position acceptance: {', '.join(f'{x:.3f}' for x in lv.get('per_position_acceptance', []))}",
            ]
        lines.append("")
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return ""
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 60 else s[:57] + "..."


def verdict_line(rep: Report) -> str:
    """One line for a person about a compatibility report: the verdict, the counts of errors and warnings, the
    first error's id and, when the live check ran, whether the output stayed identical and its acceptance length."""
    counts = rep.to_dict()["counts"]
    line = f"{'ok' if rep.ok else 'FAILED'}, {counts.get('error', 0)} error(s), {counts.get('warning', 0)} warning(s)"
    if rep.errors:
        line += f" (first: {rep.errors[0].id})"
    live = rep.live or {}
    if "identical" in live:
        line += f"; live check in vLLM: {'token-identical' if live['identical'] else 'OUTPUT CHANGED'}"
        if live.get("acceptance_length") is not None:
            line += f", acceptance length {live['acceptance_length']:.2f}"
    elif "skipped" in live:
        line += "; live check skipped"
    return line
