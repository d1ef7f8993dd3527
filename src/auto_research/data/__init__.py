"""Data: the types every level shares, reading rows from files, GSM8K, and the generation-level tasks."""
