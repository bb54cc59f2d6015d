"""Serving benchmarks over HTTP, the way ``vllm bench serve`` measures: ``runlm bench`` and bench/serve_bench.py."""
