"""The course's map: which chapter teaches which section of the source outline, and a bilingual glossary (chapter 0).

The mapping lives here and only here; `chapters/00_index.ipynb` renders it for the chapters that
exist (titles and section headings are read from the notebooks themselves), and the tests check
that every section it names exists.

    >>> from ampcourse import course
    >>> print(course.chapter_table("chapters"))     # Markdown, links relative to chapters/
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from . import formats
from .fp8 import GRANULARITIES as _GROUPS

__all__ = ["OutlineSection", "Chapter", "Term", "OUTLINE", "CHAPTER_OUTLINE", "GLOSSARY",
           "find_chapters", "chapter_table", "outline_table", "glossary_table"]


@dataclass(frozen=True)
class OutlineSection:
    """A section of the source outline and where the course teaches it."""

    number: str  # "2.3.1"
    topic: str
    chapter: int
    sections: tuple[str, ...] = ()  # chapter sections ("4.1", ...); empty: the whole chapter


@dataclass(frozen=True)
class Chapter:
    """A chapter notebook as found on disk."""

    number: int
    path: Path
    title: str  # from its "# Chapter N · ..." heading
    sections: dict[str, str]  # "1.3" -> "Rounding: small changes vanish"


@dataclass(frozen=True)
class Term:
    """A glossary entry: English, Chinese, what it means, and the chapter that teaches it."""

    en: str
    zh: str
    meaning: str
    chapter: int


#: The source outline, section by section, mapped to the chapter (and its sections) that teach it.
OUTLINE: tuple[OutlineSection, ...] = (
    OutlineSection("1", "introduction: why training uses narrow number formats", 1),
    OutlineSection("2.1", "precision basics: how floats are stored", 1, ("1.1", "1.2")),
    OutlineSection("2.1.1", "fp16 vs fp32: rounding, overflow, underflow, accumulation", 1, ("1.3", "1.4", "1.5", "1.6")),
    OutlineSection("2.1.2", "benefits of mixed precision: speed and memory", 2),
    OutlineSection("2.2.1", "autocast", 3, ("3.1", "3.2", "3.3", "3.4", "3.10")),
    OutlineSection("2.2.2", "GradScaler", 3, ("3.5", "3.6", "3.7", "3.8")),
    # The outline's 2.3 is "training with AMP": 2.3.1 initialises the AMP environment (device, autocast dtype, a
    # GradScaler: chapter 4's setup and 4.3), 2.3.2 writes the training loop (built up in 4.1-4.7 and 4.10-4.11),
    # 2.3.3 adapts model and optimizer.
    OutlineSection("2.3.1", "training with AMP: initialising the AMP environment (device, autocast dtype, GradScaler)",
                   4, ("4.0", "4.3")),
    OutlineSection("2.3.2", "training with AMP: writing the AMP training loop", 4,
                   ("4.1", "4.2", "4.4", "4.5", "4.6", "4.7", "4.10", "4.11")),
    OutlineSection("2.3.3", "training with AMP: adapting model and optimizer", 4, ("4.8", "4.9")),
    # The outline's 3.1.1 is about custom GradScaler settings (init_scale, growth, backoff): chapter 6 teaches
    # them in 6.3. Chapter 5 (fp32 islands, per-module precision, fp8) goes beyond the outline.
    OutlineSection("3.1.1", "custom precision strategies: GradScaler's init_scale, growth and backoff settings", 6,
                   ("6.3",)),
    OutlineSection("3.1.2", "loss scaling", 6),
)

#: What each chapter covers of the outline (chapters 5, 7, 8 and 9 go beyond it).
CHAPTER_OUTLINE: dict[int, str] = {
    1: "1, 2.1, 2.1.1", 2: "2.1.2", 3: "2.2.1, 2.2.2", 4: "2.3.1–2.3.3",
    5: "beyond the outline (3.1.1's theme, taken further): fp32 islands, per-module precision, fp8", 6: "3.1.1 (in 6.3), 3.1.2",
    7: "beyond the outline: multi-GPU AMP",
    8: "beyond the outline: AMP on your own model (the AMP doctor)",
    9: "beyond the outline: fp8, MX and fp4",
    10: "beyond the outline: long runs, TF32 and low-precision communication",
}

_f32, _f16, _bf16 = formats.spec("fp32"), formats.spec("fp16"), formats.spec("bf16")


def _layout(f: formats.FormatSpec) -> str:
    """'8 exponent bits, 23 mantissa bits' for a format."""
    return f"{f.exponent_bits} exponent bits, {f.mantissa_bits} mantissa bits"


#: Terms a learner meets, in English and Chinese (numbers come from ampcourse.formats, never typed).
GLOSSARY: tuple[Term, ...] = (
    Term("mixed precision", "混合精度", "compute in a 16-bit format where it is safe, keep weights and sums in fp32", 1),
    Term("single precision (fp32)", "单精度", f"the {_f32.bits}-bit IEEE float: {_layout(_f32)}", 1),
    Term("half precision (fp16)", "半精度", f"the {_f16.bits}-bit IEEE float: {_layout(_f16)}, largest value {_f16.max:g}", 1),
    Term("bfloat16 (bf16)", "脑浮点数 (bfloat16)", f"{_bf16.bits} bits, {_layout(_bf16)}: fp32's range with little precision", 1),
    Term("exponent / mantissa", "指数位 / 尾数位", "the fields of a float: the exponent sets the range, the mantissa the precision", 1),
    Term("machine epsilon", "机器精度 (机器ε)", f"the gap between 1 and the next representable number (fp16: {_f16.eps:g}, bf16: {_bf16.eps:g})", 1),
    Term("round to nearest, ties to even", "就近舍入 (偶数优先)", "IEEE rounding: to the nearest representable value; a value "
         "exactly halfway goes to the neighbour whose last mantissa bit is 0, so 1 + eps/2 rounds to 1", 1),
    Term("overflow", "上溢", f"a result too large for the format becomes inf (in fp16: anything that rounds above {_f16.max:g})", 1),
    Term("underflow", "下溢", f"a nonzero result too small for the format becomes zero (fp16: at or below half of "
         f"{_f16.min_subnormal:.3g}; exactly half is a tie, and ties round to the even neighbour, zero)", 1),
    Term("subnormal number", "非规格化数 (次正规数)", f"values below the smallest normal ({_f16.min_normal:.3g} in fp16), with fewer significant bits", 1),
    Term("accumulation in fp32", "FP32 累加", "summing low-precision products in an fp32 accumulator so small terms are not lost", 1),
    Term("tensor core", "张量核心", "GPU matrix units that multiply fp16/bf16 inputs fast and accumulate in a wider type: fp32, though fp16 GEMMs may reduce partial sums in fp16", 2),
    Term("autocast", "自动类型转换 (autocast)", "a context manager that runs each op in the dtype chosen for it: matmuls in 16 bits, losses in fp32", 3),
    Term("gradient scaling", "梯度缩放", "multiplying the loss so fp16 gradients stay above the underflow threshold, then dividing it out", 3),
    Term("loss scaling", "损失缩放", "the same idea named after what is scaled: the loss before backward()", 6),
    Term("dynamic loss scaling", "动态损失缩放", "raise the scale after a run of finite steps, halve it and skip the step on inf/nan gradients", 6),
    Term("master weights", "主权重", "the fp32 copy of the weights that the optimizer updates; low-precision copies are derived from it", 4),
    Term("gradient clipping", "梯度裁剪", "limiting the gradient norm; with a GradScaler, unscale the gradients first", 4),
    Term("gradient accumulation", "梯度累积", "summing gradients over several micro-batches before one optimizer step", 4),
    Term("stochastic rounding", "随机舍入", "rounding up with probability equal to the fraction of the gap, so small "
         "updates survive on average (pure bf16 training)", 4),
    Term("Kahan summation", "Kahan 求和 (补偿求和)", "keeping the rounding error of each addition in a compensation buffer "
         "and adding it to the next one", 4),
    Term("activation checkpointing", "激活检查点 (重计算)", "freeing activations after forward and recomputing them in "
         "backward; under autocast the recomputation runs under the forward pass's autocast state", 3),
    Term("fp32 island", "FP32 区域", "a region run with autocast disabled and inputs cast to fp32, for numerically delicate code", 5),
    Term("data parallel (DDP)", "数据并行", "one model copy per GPU; gradients averaged by all-reduce bucket by bucket during backward, overlapping it", 7),
    Term("lost update", "更新丢失", "an optimizer step smaller than half an ulp of a low-precision weight: it rounds away", 8),
    Term("microscaling (MX) format", "微缩放格式 (MX)", f"blocks of {_GROUPS['mx'][0][1]} narrow elements sharing one power-of-two (e8m0) scale", 9),
    Term("delayed scaling", "延迟缩放", "an fp8 scale taken from the amax history of earlier steps, not from the tensor being cast", 9),
    Term("attention-logit growth", "注意力 logit 增长", "pre-softmax attention scores that grow during training; in bf16 a "
         f"logit L carries an absolute error up to L * 2**{round(math.log2(_bf16.eps / 2))}, which softmax turns into "
         "wrong probabilities", 10),
    Term("QK-norm", "QK 归一化", "normalising queries and keys (per head) before the attention scores, which bounds the logits", 10),
    Term("z-loss", "z 损失", "PaLM's auxiliary loss weight * (log Z)**2 that keeps the softmax normaliser of the output logits near 0", 10),
    Term("rotary position embedding (RoPE)", "旋转位置编码", "rotating channel pairs by position * frequency; the angles "
         f"must be computed in fp32, since bf16 holds every integer only up to {2 ** (_bf16.mantissa_bits + 1)} "
         f"({2 ** (_bf16.mantissa_bits + 1) + 1} rounds to {2 ** (_bf16.mantissa_bits + 1)})", 10),
    Term("TF32 (TensorFloat-32)", "TF32 (张量浮点 32)", f"how tensor cores read fp32 matmul inputs: "
         f"{_layout(formats.FormatSpec('tf32', 8, 10))}, fp32 accumulation", 10),
    Term("silently skipped step", "静默跳过的步", "an optimizer step the GradScaler skipped while the loss looked normal; "
         "count them with the optimizer's own step counter", 10),
)


_TITLE = re.compile(r"^#\s+Chapter\s+(\d+)\s*·\s*(.+)$", re.MULTILINE)
_SECTION = re.compile(r"^##\s+(\d+\.\d+)\s+(.+)$", re.MULTILINE)


def _markdown_cells(path: Path) -> list[str]:
    """The markdown cells' text (the notebook is read as JSON: no Jupyter needed to build the index)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in nb["cells"] if c["cell_type"] == "markdown"]


def find_chapters(folder: str | Path = ".") -> dict[int, Chapter]:
    """The numbered chapter notebooks in folder (01_*.ipynb, ...; not the 00 index), by number."""
    found = {}
    for path in sorted(Path(folder).glob("[0-9][0-9]_*.ipynb")):
        number = int(path.name[:2])
        if number == 0:
            continue
        md = "\n".join(_markdown_cells(path))
        title = _TITLE.search(md)
        found[number] = Chapter(number, path, title.group(2).strip() if title else path.stem,
                                {m.group(1): m.group(2).strip() for m in _SECTION.finditer(md)})
    return found


def _link(ch: Chapter) -> str:
    """A Markdown link to a chapter, relative to its folder."""
    return f"[{ch.path.name}]({ch.path.name})"


def chapter_table(folder: str | Path = ".") -> str:
    """Markdown table of the chapters that exist: number, notebook link, title, outline sections."""
    rows = ["| # | notebook | title | source outline |", "|---|---|---|---|"]
    for n, ch in find_chapters(folder).items():
        rows.append(f"| {n} | {_link(ch)} | {ch.title} | {CHAPTER_OUTLINE.get(n, '')} |")
    return "\n".join(rows)


def outline_table(folder: str | Path = ".") -> str:
    """Markdown table: each outline section, the chapter and sections that teach it (linked where written)."""
    chapters = find_chapters(folder)
    rows = ["| outline | topic | chapter | sections |", "|---|---|---|---|"]
    for s in OUTLINE:
        ch = chapters.get(s.chapter)
        if ch is None:
            rows.append(f"| {s.number} | {s.topic} | {s.chapter} (not in this folder yet) | |")
            continue
        missing = [k for k in s.sections if k not in ch.sections]
        if missing:
            raise ValueError(f"outline {s.number} maps to sections {missing} that {ch.path.name} does not have; "
                             f"it has {sorted(ch.sections, key=_section_key)}: update OUTLINE in ampcourse/course.py")
        where = "; ".join(f"{k} {ch.sections[k]}" for k in s.sections) or "the whole chapter"
        rows.append(f"| {s.number} | {s.topic} | {s.chapter}: {_link(ch)} | {where} |")
    return "\n".join(rows)


def _section_key(number: str) -> tuple[int, ...]:
    """'4.10' sorts after '4.9'."""
    return tuple(int(p) for p in number.split("."))


def glossary_table(folder: str | Path = ".") -> str:
    """Markdown table of the glossary, English and Chinese, with the chapter that teaches each term."""
    chapters = find_chapters(folder)
    rows = ["| English | 中文 | meaning | chapter |", "|---|---|---|---|"]
    for t in sorted(GLOSSARY, key=lambda t: t.en.lower()):
        ch = chapters.get(t.chapter)
        where = f"[{t.chapter}]({ch.path.name})" if ch else str(t.chapter)
        rows.append(f"| {t.en} | {t.zh} | {t.meaning} | {where} |")
    return "\n".join(rows)
