"""Maintenance scripts: the import graph (cycles) and the generated configuration page."""
