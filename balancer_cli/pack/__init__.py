"""Packing: form groups under per-module caps (ISF and ours) and assign them to steps x ranks."""
