"""Rewards: built-in verifiers, user callables and how they combine, reward models, gold scorers and judges."""
