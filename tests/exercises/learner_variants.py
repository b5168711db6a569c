"""Wrong answers made from a right one, for the checker tests that run learner code under torchrun (7.3-7.6, 10.3)."""

import inspect


def variants(fn, **edits) -> dict:
    """{name: (source, function name)}: the reference `fn` and copies with text replaced (the wrong answers).

    Args:
        fn: the reference solution (a function whose source inspect can read).
        edits: name -> [(old, new), ...]: each wrong answer, as replacements in fn's source (each old must occur).

    Example::

        >>> variants(solution, no_average=[("/ world", "")])["no_average"][0]   # the source of one wrong answer
    """
    src = inspect.getsource(fn)
    out = {"right": (src, fn.__name__)}
    for name, pairs in edits.items():
        changed = src
        for old, new in pairs:
            assert old in changed, old
            changed = changed.replace(old, new)
        out[name] = (changed, fn.__name__)
    return out
