"""The admission check: the probe, and the check `opd admit` runs."""
