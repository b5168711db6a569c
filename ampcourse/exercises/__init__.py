"""Checkers for the chapter exercises, one module per chapter.

Each ``check_*`` function takes the learner's answer (a value or a function), prints friendly
feedback when it is right, and prints what was expected, what came back and a hint when it is wrong.
A wrong answer raises :class:`ExerciseError` (an AssertionError) in scripts and tests (and inside
``with exercises.raising():``); in a notebook the cell ends cleanly so "Run All" reaches the end.
``exercises.summary([...])`` lists which exercises pass.
"""

from ._core import ExerciseError, checker, failed, passed, raising, summary
from .ch01 import check_fp16_ulp, check_largest_exact_integer, check_subnormal_example
from .ch02 import check_adam_bytes, check_saved_bytes
from .ch03 import check_autocast_dtypes, check_scale_update
from .ch04 import check_clip_after_unscale, check_scheduler_skip
from .ch05 import check_fp8_scale, check_rms_norm, check_square_function
from .ch06 import check_no_flush_scale, check_scale_prediction, check_update_rule
from .ch07 import (check_compressed_ddp, check_data_parallel_step, check_fsdp_policy, check_rank_step,
                   check_restartable, check_state_bytes)
from .ch08 import check_fp32_islands, check_init_scale
from .ch09 import check_delayed_scales, check_mx_scale
from .ch10 import check_reduce_across_ranks, check_tf32_round, check_z_loss

__all__ = ["ExerciseError", "passed", "failed", "checker", "raising", "summary",
           "check_fp16_ulp", "check_largest_exact_integer", "check_subnormal_example",
           "check_adam_bytes", "check_saved_bytes",
           "check_autocast_dtypes", "check_scale_update",
           "check_clip_after_unscale", "check_scheduler_skip",
           "check_rms_norm", "check_square_function", "check_fp8_scale",
           "check_no_flush_scale", "check_scale_prediction", "check_update_rule",
           "check_data_parallel_step", "check_state_bytes",
           "check_rank_step", "check_compressed_ddp", "check_fsdp_policy", "check_restartable",
           "check_init_scale", "check_fp32_islands",
           "check_mx_scale", "check_delayed_scales",
           "check_tf32_round", "check_z_loss", "check_reduce_across_ranks"]

# Keep this loop last: every check_* imported above records its verdict for summary() and, in a
# notebook, shows a wrong answer without a traceback (_core.checker). A new chapter's checkers only
# need their import line above.
for _name, _fn in list(globals().items()):
    if _name.startswith("check_") and callable(_fn):
        globals()[_name] = checker(_fn)
del _name, _fn
