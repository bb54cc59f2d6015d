"""Serving runlm on other serving systems (Ray Serve: runlm/serve/ray.py)."""
