"""The compiled core's Python side: input adapters, the backends over ``richness._core`` and
``richness._cuda``, ``Moments`` and ``Similarity``, the saved-state format and the merges of whole
states (ranks, files, Dask chunks). It sits above ``finish`` (which it calls to finish a state) and
below the integrations; nothing is imported here, so each module loads on its own."""
