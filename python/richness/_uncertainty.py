"""The jackknife under its former module name; it lives in ``richness.finish.uncertainty``."""

from .finish.uncertainty import add_jackknife, t975  # noqa: F401
