"""Adapters that plug the birdenv environments into training libraries."""
