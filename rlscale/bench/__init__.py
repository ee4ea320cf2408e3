"""Benchmarks: measurements run by hand (`rlscale bench ...`), never timed tests."""
