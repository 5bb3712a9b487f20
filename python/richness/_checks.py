"""Checks of scalar arguments, in one place (integers, bools or None).

An integer is a Python int or any numpy integer (``np.int64(10)`` is accepted
wherever ``10`` is, and comes back as the Python int); bools and numpy bools
are refused (``True`` is not a count). Each refusal names the argument, what is
allowed and the value given. Imports numpy only: no torch, no compiled core.

Array contents and shapes are checked where the arrays are read, not here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Optional, Union, overload

import numpy as np

if TYPE_CHECKING:
    from typing import TypeGuard  # Python 3.10; only read by the type checker



def is_torch(x: object) -> bool:
    """Whether ``x`` is an object of torch (a tensor or not: callers that need a tensor also check for
    the attribute they use, ``data_ptr``, ``layout``, ``detach``); the one such test of the package,
    here at the bottom so that modules which must not load the compiled core (finish/, baselines) use it."""
    return type(x).__module__.split(".")[0] == "torch"

def is_int(value: object) -> TypeGuard[Union[int, np.integer]]:
    """True for a Python int or a numpy integer; False for bools and numpy
    bools, floats, strings, arrays and everything else."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _allowed(low: Optional[int], high: Optional[int], allow_none: bool) -> str:
    if low is not None and high is not None:
        what = f"an integer in [{low}, {high}]"
    elif low == 0:
        what = "a non-negative integer"
    elif low == 1:
        what = "a positive integer"
    elif low is not None:
        what = f"an integer >= {low}"
    elif high is not None:
        what = f"an integer <= {high}"
    else:
        what = "an integer"
    return what + " or None" if allow_none else what


@overload
def check_int(value: object, name: str, *, low: Optional[int] = None, high: Optional[int] = None,
              allow_none: Literal[False] = False, what: Optional[str] = None, note: Optional[str] = None) -> int: ...
@overload
def check_int(value: object, name: str, *, low: Optional[int] = None, high: Optional[int] = None,
              allow_none: bool, what: Optional[str] = None, note: Optional[str] = None) -> Optional[int]: ...
def check_int(value: object, name: str, *, low: Optional[int] = None, high: Optional[int] = None,
              allow_none: bool = False, what: Optional[str] = None, note: Optional[str] = None) -> Optional[int]:
    """``value`` as a Python int (None stays None where ``allow_none``), or a
    ValueError, for a value of the wrong type as for one out of range, worded
    ``"{name} must be {what}, got {value!r}"`` (then `` ({note})``).

    ``low`` and ``high`` are inclusive bounds; ``what`` words what is allowed
    where the default ("a positive integer", "an integer in [2, 1024] or
    None", ...) would not say it as well (it must still say the range)."""
    if value is None and allow_none:
        return None
    if not is_int(value) or (low is not None and value < low) or (high is not None and value > high):
        allowed = _allowed(low, high, allow_none) if what is None else what
        raise ValueError(f"{name} must be {allowed}, got {value!r}" + (f" ({note})" if note else ""))
    return int(value)


def check_bool(value: object, name: str) -> bool:
    """``value`` when it is True or False, else a TypeError naming ``name``
    and the type given (numpy bools and integers are refused: an explicit
    bool is asked for)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")
    return value


def check_bool_or_none(value: object, name: str) -> Optional[bool]:
    """``value`` when it is True, False or None, else a TypeError naming
    ``name`` and the type given (numpy bools are refused: an explicit bool is
    asked for)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None, got {type(value).__name__}")
    return value
