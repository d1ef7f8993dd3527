"""Reports: tables and summaries as text (tables.py), pictures (plots.py)."""
