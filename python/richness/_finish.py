"""The finishing math under its former module name; it lives in ``richness.finish``."""

from .finish import *  # noqa: F401,F403
from .finish import __all__  # noqa: F401
