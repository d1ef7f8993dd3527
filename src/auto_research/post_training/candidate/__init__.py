"""The candidate level: each problem offers 6 candidate answers and the policy
is a linear softmax over their features (see docs/candidate-protocol.md)."""
