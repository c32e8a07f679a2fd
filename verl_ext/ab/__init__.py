"""Side-by-side A/B runs of strategies (`verl-ext ab`): runner, metrics, plots."""
