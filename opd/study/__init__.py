"""Studies: sweeps, tolerance, sensitivity, fidelity, reports."""
