"""The dataset readers, one per file; :mod:`calibration.registry` maps names to them."""
