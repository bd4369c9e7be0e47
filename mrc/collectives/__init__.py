"""Collectives over the mrc transport (issue 12): see CONTRACT.md until docs say it."""
