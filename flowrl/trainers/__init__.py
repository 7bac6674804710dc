"""Trainers: one recipe per file."""
