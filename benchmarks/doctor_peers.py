"""The AMP doctor, torch.autograd.detect_anomaly and transformers' DebugUnderflowOverflow side by side on the doctor
gallery (tests/doctor_gallery.py): a table of found / named / advice-works per planted case and of false alarms on
the healthy ones.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/doctor_peers.py --out benchmarks/cpu/doctor_peers.json
    PYTHONPATH=/path/to/other/checkout .venv/bin/python benchmarks/doctor_peers.py      # judge another doctor
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/doctor_peers.py --policy both   # issue 26: per-policy truths

``--policy cuda`` judges the cases whose truth differs between CPU's and CUDA's autocast lists
(``doctor_gallery.POLICY_CASES``) with their truth under CUDA's lists: the doctor with ``examine(..., policy="cuda")``,
the peers and every training run under ``ampcourse.emulate``. ``--policy both`` judges each of those cases under
both policies (the CPU's own lists: ``examine`` without a policy, i.e. ``policy=None``) and prints them side by side.

It judges whichever ``ampcourse`` Python imports. Scores (tests/doctor_gallery.py has the rules):

- doctor: found = the planted precision is not called clean; named = an error or warning names the culprit module
  (and op, when the case has one); advice works = following the report (its verdict for the planted precision, or its
  recommended precision; fp32 islands; GradScaler scale; fp32 master weights if advised) trains like fp32 for 6 steps.
  Also counted: errors or warnings on a case's innocents (modules that only pass the trouble on, or do something
  exact), and whether examine left inputs and state bit-identical and concluded the same twice.
- detect_anomaly: found = it raises during 3 training steps in the planted precision; named = its forward traceback
  points into the culprit's forward.
- DebugUnderflowOverflow: found = it detects inf/NaN during those steps; named = the module where it detects them is
  the culprit.
- a case tagged ``[25: k]`` in the table is a variant of issue 25's class k (``Case.issue25``).
- healthy cases (fp16 and bf16 runs): quiet = no error/warning (doctor), no raise (detect_anomaly), no detection
  (DebugUnderflowOverflow).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402

import doctor_gallery as gallery  # noqa: E402


def mark(ok: bool | None) -> str:
    """A table cell for a yes/no result."""
    return "-" if ok is None else ("yes" if ok else "**no**")


def cases_for(policy: str) -> list:
    """The gallery entries judged for --policy: CASES (cpu), POLICY_CASES (cuda), or both entries of each case
    whose truth differs between the policies (both)."""
    if policy == "cpu":
        return list(gallery.CASES)
    if policy == "cuda":
        return list(gallery.POLICY_CASES)
    return [c for by in gallery.POLICY_DIFFERS.values() for c in (by["cpu"], by["cuda"])]


def judge_all(names: list[str] | None = None, cases: list | None = None) -> list[dict]:
    """Every tool on every case (or on the named ones) of cases (default: gallery.CASES): one row per case."""
    rows = []
    for c in gallery.CASES if cases is None else cases:
        if names and c.name not in names:
            continue
        t0 = time.perf_counter()
        row = {"case": c.name, "policy": c.policy, "class": c.klass, "issue25": list(c.issue25),
               "known_miss": c.known_miss, "what": c.what, "hf": c.hf, "precisions": list(c.precisions),
               "culprit": c.culprit, "culprits": list(c.culprits), "ops": list(c.ops), "phase": c.phase,
               "doctor": gallery.judge_doctor(c), "detect_anomaly": gallery.judge_anomaly(c),
               "debug_underflow_overflow": gallery.judge_debug_overflow(c)}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(f"  {c.name} ({c.policy}): {row['seconds']} s", file=sys.stderr)
    return rows


def summary(rows: list[dict]) -> dict:
    """Counts per tool: planted cases fully right and per criterion, false alarms on healthy cases, crashes."""
    planted = [r for r in rows if r["class"] > 0]
    healthy = [r for r in rows if r["class"] == 0]
    d = [r["doctor"] for r in planted]
    out = {"planted": len(planted), "healthy": len(healthy),
           "doctor": {"right": sum(x["found"] and x["named"] and x["advice_works"] for x in d),
                      "found": sum(x["found"] for x in d), "named": sum(x["named"] for x in d),
                      "advice_works": sum(x["advice_works"] for x in d),
                      "crashes": sum(r["doctor"]["crash"] is not None for r in rows),
                      "blames_innocent": {r["case"]: r["doctor"]["blames_innocent"] for r in planted
                                          if r["doctor"].get("blames_innocent")},
                      "false_alarms": sum(not r["doctor"]["quiet"] for r in healthy),
                      "inputs_changed": [r["case"] for r in rows if not r["doctor"].get("inputs_kept", True)],
                      "state_changed": [r["case"] for r in rows if not r["doctor"].get("state_kept", True)],
                      "known_misses": {r["case"]: r["known_miss"] for r in rows if r.get("known_miss")},
                      "differs_twice": [r["case"] for r in rows
                                        if r["doctor"]["crash"] is None and not r["doctor"]["same_twice"]]}}
    for tool in ("detect_anomaly", "debug_underflow_overflow"):
        t = [r[tool] for r in planted]
        out[tool] = {"right": sum(x["found"] and x["named"] for x in t), "found": sum(x["found"] for x in t),
                     "named": sum(x["named"] for x in t),
                     "false_alarms": sum(not r[tool]["quiet"] for r in healthy)}
    return out


def markdown(rows: list[dict], s: dict) -> str:
    """The table and the totals as markdown."""
    lines = ["| case | class | culprit | doctor found / named / advice works | detect_anomaly found / named "
             "| DebugUnderflowOverflow found / named |", "|---|---|---|---|---|---|"]
    for r in rows:
        d, a, u = r["doctor"], r["detect_anomaly"], r["debug_underflow_overflow"]
        culprit = f"`{r['culprit']}`" if r["culprit"] else "(whole model)"
        if len(r["culprits"]) > 1:
            culprit += f" (+{len(r['culprits']) - 1})"
        if r["class"] > 0:
            doc = "crash" if d["crash"] else f"{mark(d['found'])} / {mark(d['named'])} / {mark(d['advice_works'])}"
            cells = [doc, f"{mark(a['found'])} / {mark(a['named'])}", f"{mark(u['found'])} / {mark(u['named'])}"]
        else:
            culprit = "healthy"
            cells = ["crash" if d["crash"] else ("quiet" if d["quiet"] else "**false alarm**")] + [
                "quiet" if x["quiet"] else "**false alarm**" for x in (a, u)]
        where = f" ({r['policy']})" if r.get("policy", "cpu") != "cpu" else ""
        tag = f" [25: {', '.join(map(str, r['issue25']))}]" if r.get("issue25") else ""
        lines.append(f"| {r['case']}{where}{' (HF)' if r['hf'] else ''}{tag} | {r['class'] or '-'} | {culprit} | "
                     + " | ".join(cells) + " |")
    n = s["planted"]
    lines += ["", f"Planted cases fully right (found + named + advice works for the doctor; found + named for the "
              f"peers), of {n}: doctor {s['doctor']['right']}, detect_anomaly {s['detect_anomaly']['right']}, "
              f"DebugUnderflowOverflow {s['debug_underflow_overflow']['right']}.",
              f"Doctor: found {s['doctor']['found']}, named {s['doctor']['named']}, advice works "
              f"{s['doctor']['advice_works']}, crashed on {s['doctor']['crashes']}; errors or warnings on modules that "
              f"only pass the trouble on: {s['doctor']['blames_innocent'] or 'none'}; left the caller's inputs changed "
              f"in {s['doctor']['inputs_changed'] or 'none'}, the model's or optimizer's state in "
              f"{s['doctor']['state_changed'] or 'none'}; concluded differently on a second call in "
              f"{s['doctor']['differs_twice'] or 'none'}.",
              f"Known doctor misses (Case.known_miss, asserted by tests/test_doctor_gallery.py): "
              f"{s['doctor'].get('known_misses') or 'none'}.",
              f"False alarms on {s['healthy']} healthy cases: doctor {s['doctor']['false_alarms']}, detect_anomaly "
              f"{s['detect_anomaly']['false_alarms']}, DebugUnderflowOverflow "
              f"{s['debug_underflow_overflow']['false_alarms']}."]
    return "\n".join(lines)


def _doctor_cell(r: dict) -> str:
    """What the doctor concluded on one row, judged against that row's truth."""
    d = r["doctor"]
    if d["crash"]:
        return "crash"
    if r["class"] > 0:
        right = d["found"] and d["named"] and d["advice_works"]
        return ("right: " if right else "**wrong**: ") + (", ".join(d["loud"][:1]) or "quiet")
    return "right: quiet" if d["quiet"] else "**false alarm**: " + ", ".join(d["loud"][:2])


def policy_markdown(rows: list[dict]) -> str:
    """The cases judged under both policies, side by side: per policy, the truth and what the doctor said."""
    by = {}
    for r in rows:
        by.setdefault(r["case"], {})[r["policy"]] = r
    lines = ["| case | CPU's lists: truth | `examine(...)` (policy=None) | CUDA's lists: truth "
             "| `examine(..., policy=\"cuda\")` |", "|---|---|---|---|---|"]
    right = 0
    for name, pols in by.items():
        cells = []
        for pol in ("cpu", "cuda"):
            r = pols.get(pol)
            if r is None:
                cells += ["-", "-"]
                continue
            truth = f"broken in {', '.join(r['precisions'])}" if r["class"] > 0 else "healthy"
            cells += [truth, _doctor_cell(r)]
            right += cells[-1].startswith("right")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"The doctor is right on {right} of {sum(len(p) for p in by.values())} (case, policy) pairs."]
    return "\n".join(lines)


def _cpu_model() -> str:
    """The CPU's model name as lscpu and /proc/cpuinfo give it ("" where neither says)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--out", default=None, help="write the rows and totals as JSON here")
    ap.add_argument("--policy", choices=("cpu", "cuda", "both"), default="cpu",
                    help="whose autocast lists the truths are for (see the module docstring)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import ampcourse
    import transformers
    measured = {"utc_start": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "cpu": _cpu_model(),
                "cores": os.cpu_count(), "load_before": [round(v, 2) for v in os.getloadavg()]}
    t0 = time.perf_counter()
    rows = judge_all([n for n in args.cases.split(",") if n] or None, cases_for(args.policy))
    measured.update(utc_end=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                    load_after=[round(v, 2) for v in os.getloadavg()], wall_s=round(time.perf_counter() - t0, 1))
    s = summary(rows)
    print(f"ampcourse from {os.path.dirname(ampcourse.__file__)}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}; {measured['cpu']} ({measured['cores']} cores), {measured['utc_start']} to "
          f"{measured['utc_end']} UTC, {measured['wall_s']} s, load {measured['load_before']} -> "
          f"{measured['load_after']}\n")
    print(markdown(rows, s))
    if args.policy == "both":
        print("\n" + policy_markdown(rows))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"torch": torch.__version__, "transformers": transformers.__version__, "policy": args.policy,
                       "measured": measured, "summary": s,
                       "rows": rows}, fh, indent=1, default=str)
            fh.write("\n")


if __name__ == "__main__":
    main()
