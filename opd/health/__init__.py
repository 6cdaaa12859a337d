"""What the admission check and the runtime guard judge: metrics, rules, thresholds, the guard."""
