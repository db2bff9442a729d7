"""nanoPD's tools beside the engine, run by bench.py: the serving benchmark's parts beside its
runs (the HTTP client, the timelines, the frontier, the record, the plots), the micro-benchmarks,
the replays of a recorded run and the docs' figures."""
