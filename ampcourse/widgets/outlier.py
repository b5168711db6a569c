"""The outlier explorer: one outlier against the scaling granularity, per tensor, row or block (chapter 9).

    >>> w = outlier_explorer()
    >>> w.magnitude.value = 10          # the outlier becomes 2**10
    >>> w.results["tensor"]["rel_error"]
"""

from __future__ import annotations

import html

import ipywidgets as W

from .. import _args, formats
from .common import _CELL, _NUM, _Guarded

__all__ = ["OutlierExplorer", "outlier_explorer"]


class OutlierExplorer(_Guarded, W.VBox):
    """Move one outlier and the block size; see each scaling granularity's error (chapter 9).

        >>> w = outlier_explorer()
        >>> w.magnitude.value = 10          # the outlier becomes 2**10
        >>> w.block.value = 16              # blocks of 16 for the two block schemes
        >>> w.results["tensor"]["rel_error"], w.results["block e8m0"]["underflowed"]
        >>> w.results["tensor"]["median_rel_error"]  # the typical element: 1.0 when flushed to zero

    Schemes (keys of ``results``): "tensor", "row", "block fp32" (fp32 scale per block), "block e8m0"
    (MX: power-of-two scale per block), and "nvfp4" when the element format is fp4_e2m1 and the rows split into
    NVFP4's blocks of 16 (rows of 8, 24, 40... have no nvfp4 row).
    """

    def __init__(self, x=None, element: str = "fp4_e2m1", magnitude: int = 8, position: int = 5, block_size: int = 32,
                 seed: int = 0):
        import torch

        magnitude = _args.integer(magnitude, "magnitude", low=0, high=16, what="an int from 0 to 16 (the slider's range)")
        position, block_size = _args.integer(position, "position", low=0), _args.integer(block_size, "block_size", low=1)
        if x is None:
            x = torch.randn(4, 256, generator=torch.Generator().manual_seed(_args.seed(seed)))
        x = formats._real_array(x, "x")  # numbers as float64, or ValueError naming x
        if x.ndim == 0 or x.size == 0:
            raise ValueError(f"x must be a non-empty array of numbers (rows of values), got shape {x.shape}")
        self.base = torch.as_tensor(x, dtype=torch.float64).reshape(-1, torch.as_tensor(x).shape[-1]).clone()
        cols = self.base.shape[1]
        blocks = [b for b in (8, 16, 32, 64, 128) if cols % b == 0]
        if not blocks:
            raise ValueError(f"x needs a row length divisible by 8, got {cols}")
        if block_size not in blocks:
            raise ValueError(f"block_size must be one of {blocks} for rows of {cols}, got {block_size!r}")
        element = formats.spec(element).name
        elements = formats.mx_elements()
        if element not in elements:
            raise ValueError(f"element must be one of {', '.join(elements)}, got {element!r}")
        if not 0 <= position < cols:
            raise ValueError(f"position must be in 0..{cols - 1}, got {position!r}")
        self.element = W.Dropdown(options=elements, value=element, description="element")
        self.magnitude = W.IntSlider(value=magnitude, min=0, max=16, description="log2 outlier")
        self.position = W.IntSlider(value=position, min=0, max=cols - 1, description="position")
        self.block = W.Dropdown(options=blocks, value=block_size, description="block size")
        self.table = W.HTML()
        self.table.add_class("ampcourse-outlier-table")  # for the browser test
        self.message = W.HTML()  # _Guarded: what a refused value shows
        self.results: dict[str, dict[str, float]] = {}
        for control in (self.element, self.magnitude, self.position, self.block):
            self._watch(control, lambda change: self._update())
        super().__init__([W.HBox([self.element, self.block]), W.HBox([self.magnitude, self.position]), self.message,
                          self.table])
        self._update()

    def __repr__(self) -> str:
        return (f"OutlierExplorer(element={self.element.value!r}, outlier=2**{self.magnitude.value}, "
                f"position={self.position.value}, block={self.block.value})")

    def tensor(self):
        """The tensor being quantized: the base values with row 0's element at `position` set to the outlier."""
        x = self.base.clone()
        x[0, self.position.value] = 2.0**self.magnitude.value
        return x

    def _update(self) -> None:
        """Quantize with every scheme and refresh results and the table."""
        from .. import fp8

        x, el, b = self.tensor(), self.element.value, self.block.value
        schemes = {"tensor": ("tensor", None), "row": ("row", None), "block fp32": ("1x128", b), "block e8m0": ("mx", b)}
        if el == "fp4_e2m1" and _fits_nvfp4(x.shape[1]):  # rows of 8, 24, 40...: no 1x16 blocks, no nvfp4 row
            schemes["nvfp4"] = ("nvfp4", None)
        self.results = {}
        for name, (gran, size) in schemes.items():
            r = fp8.quantize_scaled(x, el, gran, block_size=size)
            self.results[name] = {"rel_error": fp8.relative_error(x, r.values),
                                  "median_rel_error": fp8.median_relative_error(x, r.values),
                                  "sqnr_db": fp8.sqnr_db(x, r.values),
                                  "underflowed": r.underflowed, "saturated": r.saturated}
        self.table.value = self._table_html()

    def _table_html(self) -> str:
        """The results as an HTML table, 9.3's columns, with a bar per scheme: the typical element's error (1 = flushed).

        Two errors, as in 9.3: ``relative error`` (||x - q|| / ||x||) is dominated by the largest values, so it
        can fall while the outlier grows; ``typical`` (the median of |x_i - q_i| / |x_i|) is what an ordinary
        element suffers, and it is what jumps when a coarse scale flushes the rest of the tensor to zero.
        """
        rows = []
        for name, r in self.results.items():
            width = int(160 * min(r["median_rel_error"], 1.0))
            rows.append(f"<tr><td {_CELL}>{html.escape(name)}</td><td {_NUM}>{r['median_rel_error']:.4f}</td>"
                        f"<td {_NUM}>{r['rel_error']:.4f}</td><td {_NUM}>{r['sqnr_db']:.1f}</td>"
                        f"<td {_NUM}>{r['underflowed']:,}</td><td {_NUM}>{r['saturated']:,}</td>"
                        f'<td {_CELL}><div style="background:#d62728;height:10px;width:{width}px"></div></td></tr>')
        head = "".join(f"<th {_CELL}>{h}</th>" for h in ("scheme", "typical error", "relative error", "SQNR dB",
                                                         "flushed to 0", "saturated", "typical error (bar: 1 = all lost)"))
        return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _fits_nvfp4(cols: int) -> bool:
    """Whether rows of cols values split into NVFP4's blocks (fp8.GRANULARITIES: 1x16), as compare_granularities asks.

    Args:
        cols: the row length.

    Example:
        >>> _fits_nvfp4(256), _fits_nvfp4(24)
        (True, False)
    """
    from .. import fp8

    return cols % fp8.GRANULARITIES["nvfp4"][0][1] == 0


def outlier_explorer(x=None, element: str = "fp4_e2m1", magnitude: int = 8, position: int = 5,
                     block_size: int = 32) -> OutlierExplorer:
    """Chapter 9: one outlier, a block size, and the error of per-tensor, per-row and block scaling."""
    return OutlierExplorer(x, element, magnitude, position, block_size)
