"""The candidate level: a linear softmax policy over 6 candidate answers (docs/candidate-protocol.md)."""
