"""Confirmation by training: the recipes the doctor would recommend, trained beside fp32 with ampcourse.trial."""

from __future__ import annotations

from typing import Any


def confirm(ctx, ev, decision, optimizer, steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return {}, {}
