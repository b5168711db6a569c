"""Checkers for the chapter exercises, one module per chapter.

Each ``check_*`` function takes the learner's answer (a value or a function), prints friendly
feedback when it is right, and raises :class:`ExerciseError` (an AssertionError) with what was
expected, what came back and a hint when it is wrong.
"""

from ._core import ExerciseError, failed, passed
from .ch01 import check_fp16_ulp, check_largest_exact_integer, check_subnormal_example
from .ch04 import check_clip_after_unscale, check_scheduler_skip
from .ch07 import check_data_parallel_step, check_state_bytes

__all__ = ["ExerciseError", "passed", "failed",
           "check_fp16_ulp", "check_largest_exact_integer", "check_subnormal_example",
           "check_clip_after_unscale", "check_scheduler_skip",
           "check_data_parallel_step", "check_state_bytes"]
