"""Benchmarks: each runs from the command line (python -m benchmarks.NAME), prints a table, writes JSON."""
