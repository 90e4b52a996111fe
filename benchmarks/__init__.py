"""Benchmarks: each script compares Tensormorph against its anchor in the same run.

Run them all with `make bench` (`python -m benchmarks.run_all`); results land in
`benchmarks/results/<name>.json` and feed the README's performance table.
"""
