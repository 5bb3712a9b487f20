"""The warning category of richness, at the bottom of the package: every
module that warns (the accumulators, the finish, the plots, the integrations)
imports it from here, so that none of them imports an integration for it."""


class RichnessWarning(UserWarning):
    """A caveat of a report (finite n, rank cut, NC1 precision), also in ``report.warnings``."""
