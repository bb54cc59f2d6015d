"""The runner: the daemon that loads models on demand into backend processes and serves the APIs."""
