"""The study built on the results: recommendations (and, next, generated findings)."""
