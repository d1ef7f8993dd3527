"""The algorithms: one frozen record each (registry.py), their token-level estimators and losses in torch
(estimators.py, losses.py), and their candidate-level NumPy twins (candidate.py)."""
