"""Token sampling (pure numpy) and stop-string handling."""
