"""Post-training: one loop, one estimator module, algorithms as small functions."""
