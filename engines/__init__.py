"""Offline build pipeline: turn source models into the engines the daemon loads."""
