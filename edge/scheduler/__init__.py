"""Queues and branch workers between intake and the models."""
