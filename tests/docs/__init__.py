"""Tests of the documentation: its code runs as written."""
