"""kvps bench: side-by-side benchmarks against the systems users would pick instead."""
