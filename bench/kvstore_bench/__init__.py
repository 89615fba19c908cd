"""Offline trace-replay benchmark tools: trace loaders, cache simulation, synthetic traces."""
