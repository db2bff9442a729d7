"""nanoPD's tools beside the engine: the micro-benchmarks and the docs' figures, run by bench.py."""
