"""Renderers of a :class:`~ampcourse.doctor.report.Report`: plain text, HTML for Jupyter, and a matplotlib plot."""

from __future__ import annotations

import html
import math
from typing import Any

from .. import formats
from .vocab import SEVERITIES, quoted

# What these functions take is a doctor Report (ampcourse.doctor.report), which imports this module to render itself;
# annotating it as Any keeps the import one way, report -> render, with no circle even for type checkers.
Report = Any

__all__ = ["text", "html_page", "plot"]


def _fmt_value(v: float) -> str:
    """A finding's value in a few characters."""
    return f"{v:.3g}" if math.isfinite(v) else str(v)


def headline(r: Report) -> str:
    """The first line: what to use. Derived with the verdicts from the findings (:mod:`.verdict`), stored on the
    report; a report built by hand without one gets a plain summary of its recommendation."""
    if r.headline:
        return r.headline
    islands = f" with fp32 modules {', '.join(quoted(n) for n in r.fp32_modules)}" if r.fp32_modules else ""
    return f"AMP doctor on {r.device}: use {r.recommended_precision}{islands}"


def _verdict_line(p: str, v) -> str:
    line = getattr(v, "line", None)
    if callable(line):
        return line()
    return f"{p}: {v.get('status')}" + (f" ({v['reason']})" if v.get("reason") else "")


def text(r: Report) -> str:
    """Plain text: the recommendation, the verdict per precision, every finding (worst first), advice and notes."""
    lines = [headline(r)]
    lines += [f"  {_verdict_line(p, v)}" for p, v in r.verdicts.items()]
    n = {sev: sum(f.severity == sev for f in r.findings) for sev in SEVERITIES}
    lines.append(f"{n['error']} error(s), {n['warning']} warning(s), {n['info']} note(s):")
    lines += [f"  [{f.severity}] {f.kind} ({f.precision}, {f.phase}{', ' + quoted(f.module) if f.module else ''}"
              f"{', ' + f.op if f.op else ''}): {f.message}" for f in r.findings]
    lines += ["advice:"] + [f"  - {a}" for a in r.advice]
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def _code(text: str) -> str:
    """A table cell's code, or nothing for an empty one (an empty <code> draws a grey box in Jupyter)."""
    return f"<code>{html.escape(text)}</code>" if text else ""


def html_page(r: Report) -> str:
    """An HTML summary for Jupyter: recommendation, verdicts, findings table (worst first), advice, snippets, notes."""
    colour = {"error": "#c0392b", "warning": "#d68910", "info": "#2e86c1"}
    left = "text-align:left;vertical-align:top"  # Jupyter centres table cells; prose reads left-aligned
    rows = "".join(
        f"<tr><td style='color:{colour[f.severity]};{left}'><b>{f.severity}</b></td><td style='{left}'>"
        f"{html.escape(f.kind)}</td><td style='{left}'>{html.escape(f.precision)}</td><td style='{left}'>"
        f"{html.escape(f.phase)}</td><td style='{left}'>{_code(f.module and quoted(f.module))}</td>"
        f"<td style='{left}'>{_code(f.op)}</td><td style='{left}'>{html.escape(_fmt_value(f.value))}</td>"
        f"<td style='{left}'>{html.escape(f.message)}</td></tr>" for f in r.findings)
    verdicts = "".join(f"<li>{html.escape(_verdict_line(p, v))}</li>" for p, v in r.verdicts.items())
    advice = "".join(f"<li>{html.escape(a)}</li>" for a in r.advice)
    notes = "".join(f"<p><i>{html.escape(n)}</i></p>" for n in r.notes)
    snippet = f"<pre>{html.escape(r.policy_snippet())}</pre>"
    head = "".join(f"<th style='{left}'>{h}</th>" for h in ("severity", "kind", "precision", "phase", "module", "op",
                                                           "value", "message"))
    return (f"<div><h4>{html.escape(headline(r))}</h4><ul>{verdicts}</ul><table><tr>{head}</tr>{rows}"
            f"</table><p><b>Advice</b></p><ul>{advice}</ul>{snippet}{notes}</div>")


def plot(r: Report, ax=None):
    """Per module: the log2 range of its outputs (fp32 run) and output gradients against fp16's and bf16's windows."""
    import matplotlib.pyplot as plt

    mods = [m for m in r.modules if m["leaf"] and m["act_max"] > 0]
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.32 * len(mods) + 1.6))
    else:
        fig = ax.figure
    for fmt, colour in (("bf16", "#d5f5e3"), ("fp16", "#d6eaf8")):
        f = formats.spec(fmt)
        lo, hi = math.log2(f.min_subnormal), math.log2(f.max)
        ax.axvspan(max(lo, -60), min(hi, 30), color=colour, alpha=0.6, zorder=0,
                   label=f"{fmt}: 2^{lo:.0f} .. {f.max:.3g}" if fmt == "fp16" else f"{fmt} (wider than shown)")
    ax.axvline(math.log2(formats.spec("fp16").min_normal), color="#2e86c1", lw=0.8, ls=":",
               label="fp16 smallest normal")
    for i, m in enumerate(mods):
        for key, dy, colour, label in (("act", -0.15, "#1f618d", "activations"), ("grad", 0.15, "#b03a2e", "gradients")):
            lo, hi = m[f"{key}_min"], m[f"{key}_max"]
            if hi > 0:
                ax.plot([math.log2(lo), math.log2(hi)], [i + dy, i + dy], color=colour, lw=3,
                        label=label if i == 0 else None)
    ax.set_yticks(range(len(mods)), [quoted(m["name"]) for m in mods], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("log2 |value| (smallest occupied binade to max)")
    ax.set_xlim(-60, 30)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    ax.set_title(f"AMP doctor: value ranges per module ({r.device})")
    fig.tight_layout()
    return fig
