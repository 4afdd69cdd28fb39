"""Teaching tools for the lessons and benchmarks only: cost models, dry runs, arrival traces."""
