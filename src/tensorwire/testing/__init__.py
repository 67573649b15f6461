"""Helpers for testing code built on tensorwire: ``launch`` runs a function on N local ranks."""

from .launch import RankFailedError, free_port, launch

__all__ = ["launch", "free_port", "RankFailedError"]
