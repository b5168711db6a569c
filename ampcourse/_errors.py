"""What an error raised inside the learner's model says: a kernel missing for a dtype, and the learner's own line.

One home for both, read by the emulator (which runs an op without a CPU fp16/bf16 kernel in fp32), the doctor (a
precision this device cannot run is `unsupported`, not the model's fault) and ``trial`` (a run that raises names
where).
"""

from __future__ import annotations

import os
import traceback

import torch

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def missing_kernel(err: BaseException) -> bool:
    """Whether err says this device or torch build has no kernel for an op's dtype (not that the model is wrong).

    "... not implemented for 'Half'" (most ops), "Unsupported dtype BFloat16" (torch.fft on a CPU), or a
    NotImplementedError.

    Args:
        err: the exception.

    Example::

        >>> missing_kernel(RuntimeError("Unsupported dtype Half")), missing_kernel(RuntimeError("shape mismatch"))
        (True, False)
    """
    text = str(err)
    return isinstance(err, NotImplementedError) or "not implemented for" in text or "Unsupported dtype" in text


def missing_low_kernel(err: BaseException) -> bool:
    """:func:`missing_kernel` for fp16 or bf16 by name (the emulator's test for running an op in fp32 instead).

    Example::

        >>> missing_low_kernel(RuntimeError('"addmm" not implemented for \\'Half\\''))
        True
    """
    text = str(err)
    return ("not implemented for" in text and ("'Half'" in text or "'BFloat16'" in text)) or any(
        f"Unsupported dtype {name}" in text for name in ("Half", "BFloat16"))


def learner_line(err: BaseException) -> str:
    """The innermost line of the learner's code in err's traceback, or "" when every frame is torch's or ampcourse's.

    Args:
        err: an exception that has been raised (it carries its traceback).

    Example::

        >>> try:
        ...     torch.fft.rfft(torch.ones(4, dtype=torch.float16))
        ... except RuntimeError as e:
        ...     learner_line(e).startswith("`torch.fft.rfft(")
        True
    """
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not os.path.abspath(f.filename).startswith((_PACKAGE, _TORCH))]
    if not frames:
        return ""
    f = frames[-1]
    code = f"`{f.line.strip()}` " if f.line else ""
    return f"{code}({os.path.basename(f.filename)}:{f.lineno}, in {f.name})"
